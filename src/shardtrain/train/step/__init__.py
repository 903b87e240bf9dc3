"""`shardtrain.train.step`: the optimizer step (micro-steps, the exact loss and its chunked and router parts, the
optimizer, the flow rules, preemption, the batch finder)."""
