"""`shardtrain.train.model`: the model's preparation (adapters, context parallelism, parallelize), LoRA, and
saving it."""
