"""Trainer, arguments, data, optimisation (import the submodules: `shardtrain.train.trainer`, ...)."""
