"""`shardtrain.train.eval`: the evaluation and prediction loop, and generation under FSDP2."""
