"""`shardtrain.train.args`: TrainingArguments' checks, the run's preflight (resume choice, dataset checks), and
Hugging Face's field and method tables."""
