"""predict_with_generate's prompt/answer split and how generated rows end (no process group needed)."""

import torch
from tiny_models import tiny_llama

from shardtrain.train.eval.generation import generate_answers, prompts_and_answers


def test_prompt_is_everything_before_the_first_label():
    batch = {"input_ids": torch.tensor([[0, 7, 8, 9, 3], [5, 6, 9, 4, 2]]),
             "attention_mask": torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]),
             "labels": torch.tensor([[-100, -100, -100, 9, 3], [-100, -100, -100, -100, -100]])}
    prompts, answers = prompts_and_answers(batch)
    assert prompts == [[7, 8], [5, 6, 9, 4, 2]]  # left padding dropped; a row without labels is all prompt
    assert answers == [[9, 3], []]


def test_a_row_ends_after_its_first_stop_token_even_when_it_is_also_the_padding():
    model = tiny_llama().eval()
    batch = {"input_ids": torch.tensor([[5, 9, 14, 3, 20, 21]]), "labels": torch.tensor([[-100] * 4 + [20, 21]])}
    free, _ = generate_answers(model, batch, pad_token_id=0, stop_token_ids=set())
    stop = free[0][0]  # make the first generated token the EOS, and the padding too (a model without a pad token)
    got, answers = generate_answers(model, batch, pad_token_id=stop, stop_token_ids={stop})
    assert answers == [[20, 21]] and len(free[0]) == 2
    assert got == [[stop]]  # kept: a reference answer ends with its EOS


def test_eval_generator_uses_the_eos_as_padding_and_refuses_a_model_that_cannot_generate():
    import pytest
    from transformers import BertConfig, BertForSequenceClassification

    from shardtrain.errors import TrainingArgumentsError
    from shardtrain.train.eval.generation import eval_generator

    model = tiny_llama().eval()
    model.generation_config.pad_token_id = None
    batch = {"input_ids": torch.tensor([[5, 9, 14, 3, 20, 21]]), "labels": torch.tensor([[-100] * 4 + [20, 21]])}
    eos = model.generation_config.eos_token_id
    expected = generate_answers(model, batch, pad_token_id=eos, stop_token_ids={eos})
    assert eval_generator(model, causal_lm=True, max_length=None, num_beams=None)(batch) == expected
    classifier = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=8))
    with pytest.raises(TrainingArgumentsError, match="predict_with_generate needs a causal language model.*"
                                                     "BertForSequenceClassification"):
        eval_generator(classifier, causal_lm=False, max_length=None, num_beams=None)
