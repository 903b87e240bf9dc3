"""`shardtrain.train.metrics`: metrics.jsonl (tokens/s and memory per rank) and report.png."""
