"""Pre-training checks never crash on a model they do not understand."""

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from shardtrain.train.data.validation import ModelLimits


class RegressionConfig(PretrainedConfig):
    model_type = "tiny-regression"


class Regressor(PreTrainedModel):
    """A head on float features: no input embeddings at all (transformers' get_input_embeddings raises)."""

    config_class = RegressionConfig

    def __init__(self, config: RegressionConfig) -> None:
        super().__init__(config)
        self.head = nn.Linear(4, 1)
        self.post_init()

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None):
        return {"logits": self.head(features)}


def test_model_limits_of_a_model_without_input_embeddings():
    model = Regressor(RegressionConfig())
    with pytest.raises(NotImplementedError):  # what made the check crash before
        model.get_input_embeddings()
    limits = ModelLimits.of(model, shift_labels=False)
    assert limits.vocab_size is None and limits.num_labels is None
