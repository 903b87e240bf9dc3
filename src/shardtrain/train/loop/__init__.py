"""The training loop (`TrainingRun`) and resuming a run (`resume`)."""
