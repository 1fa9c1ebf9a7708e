"""The load specification: one frozen value, made alike from zerolite.load's keywords and from the
command line's load options, which the planner replaces rather than edits."""

from __future__ import annotations

import dataclasses

import pytest

from zerolite.cli.options import LOAD_OPTIONS, to_load_spec
from zerolite.errors import ZeroliteError
from zerolite.runtime.load_spec import LoadSpec
from zerolite.runtime.policy import Policy


def test_every_load_option_is_a_field_and_the_defaults_ask_for_the_default_policy():
    fields = {field.name for field in dataclasses.fields(LoadSpec)}
    assert set(LOAD_OPTIONS) <= fields
    from_options = to_load_spec({name: default for name, (_, default) in LOAD_OPTIONS.items()})
    assert from_options.policy() == LoadSpec().policy() == Policy()


def test_sizes_are_read_once_and_a_bad_one_is_one_line():
    spec = LoadSpec(model="m", gpu_memory="2GB", cpu_memory="1.5GiB", prefetch_depth=3)
    assert (spec.gpu_memory, spec.cpu_memory) == (2 * 10**9, int(1.5 * 2**30))
    assert spec.policy() == Policy(gpu_memory=2 * 10**9, cpu_memory=int(1.5 * 2**30), prefetch_depth=3)
    with pytest.raises(ZeroliteError, match="`cpu_memory` 'lots' is not a size"):
        LoadSpec(cpu_memory="lots")


def test_a_spec_is_frozen_and_a_choice_makes_a_new_one():
    spec = LoadSpec(model="m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.cpu_memory = 0
    chosen = dataclasses.replace(spec, cpu_memory=0, prefetch_depth=4)
    assert (spec.cpu_memory, spec.prefetch_depth) == (None, None)
    assert chosen.policy().prefetch_depth == 4 and chosen.model == "m"


def test_a_policy_setting_it_refuses_is_refused_when_the_policy_is_made():
    with pytest.raises(ZeroliteError, match="`prefetch_depth` must be at least 1"):
        LoadSpec(prefetch_depth=0).policy()
