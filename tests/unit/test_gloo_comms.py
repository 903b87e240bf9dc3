"""SHARDTRAIN_GLOO_REDUCE_SCATTER: the words it takes and the error for others (the collective itself is tested on
2 and 4 real ranks in tests/distributed/test_fsdp_equivalence.py)."""

import pytest

from shardtrain.config import env
from shardtrain.parallel.gloo_comms import gloo_reduce_scatter_choice


@pytest.mark.parametrize("value,choice", [(None, "all_to_all"), ("", "all_to_all"), ("native", "native"),
                                          (" NATIVE ", "native"), ("all_to_all", "all_to_all")])
def test_choice(monkeypatch, value, choice):
    if value is None:
        monkeypatch.delenv(env.GLOO_REDUCE_SCATTER, raising=False)
    else:
        monkeypatch.setenv(env.GLOO_REDUCE_SCATTER, value)
    assert gloo_reduce_scatter_choice() == choice


def test_other_words_are_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv(env.GLOO_REDUCE_SCATTER, "ring")
    with pytest.raises(env.EnvError, match="SHARDTRAIN_GLOO_REDUCE_SCATTER='ring' is not one of "
                                           r"\['all_to_all', 'native'\]; unset it"):
        gloo_reduce_scatter_choice()
