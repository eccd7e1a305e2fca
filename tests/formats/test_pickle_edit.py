"""`formats.pickle_edit.drop_dict_keys`: entries cut out of a pickled dict without running it, the other bytes kept,
references into a cut entry replayed when the object is whole where memoised, refused otherwise."""

from __future__ import annotations

import collections
import pickle

import pytest

from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.pickle_edit import PickleEditError, drop_dict_keys


def test_entries_go_and_shared_strings_and_tuples_are_written_again() -> None:
    betas = (0.9, 0.95)
    weights = collections.OrderedDict(w=[1.0, 2.0])
    weights._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    state = {
        "epoch": 1,
        "state_dict": weights,
        "optimizer_states": [{"param_groups": [{"lr": 0.1, "betas": betas}]}],
        "lr_schedulers": [{"last_epoch": 3}],
        "hyper_parameters": {"lr": 0.1, "betas": betas},
    }
    cut = pickle.loads(drop_dict_keys(pickle.dumps(state, protocol=2), {"optimizer_states", "lr_schedulers"}))
    assert cut == {k: v for k, v in state.items() if k not in ("optimizer_states", "lr_schedulers")}
    assert cut["state_dict"]._metadata == weights._metadata  # type: ignore[attr-defined]


@pytest.mark.parametrize("size", [1, 2500])  # one SETITEM; SETITEMS in batches of 1000
def test_any_entry_of_any_size_of_dict(size: int) -> None:
    state = {f"k{i}": i for i in range(size - 1)} | {"optimizer_states": [1, 2]}
    cut = pickle.loads(drop_dict_keys(pickle.dumps(state, protocol=2), {"optimizer_states"}))
    assert cut == {k: v for k, v in state.items() if k != "optimizer_states"}


def test_a_dict_shared_with_a_cut_entry_and_other_pickles_are_refused() -> None:
    shared = {"lr": 0.1}
    with pytest.raises(PickleEditError, match="dict, list or object"):
        drop_dict_keys(pickle.dumps({"optimizer_states": [shared], "h": shared}, protocol=2), {"optimizer_states"})
    with pytest.raises(PickleEditError, match="protocol 4"):
        drop_dict_keys(pickle.dumps({"a": 1}, protocol=4), {"a"})
    with pytest.raises(PickleEditError, match="not a dict"):
        drop_dict_keys(pickle.dumps([1, 2], protocol=2), {"a"})
    with pytest.raises(CorruptCheckpoint):
        drop_dict_keys(b"\x80\x02}q\x00(X", {"a"})
