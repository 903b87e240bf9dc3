"""`shardtrain.train.data`: the batch plans (a dataset's, a stream's, a foreign loader's), collation, packing and
the dataset checks."""
