"""`kit bench --help`: the options first, each with its help, named as vLLM names
the same settings, the kit's older spellings kept as aliases."""

from __future__ import annotations

import argparse

import pytest

from kit.bench import run

pytestmark = pytest.mark.cpu


def test_every_option_has_help() -> None:
    for action in run.build_parser()._actions:
        assert action.help and action.help != argparse.SUPPRESS, action.option_strings


def test_the_options_come_before_the_method() -> None:
    text = run.build_parser().format_help()
    assert text.index("options:") < text.index("Prompt pair")


@pytest.mark.parametrize(
    "vllm_name,old_name,dest",
    [
        ("--block-size", "--block", "block"),
        ("--prefix-match-unit", "--unit", "unit"),
        ("--num-speculative-tokens", "--num-spec", "num_spec"),
    ],
)
def test_vllm_names_and_the_old_spellings_set_the_same_value(
    vllm_name: str, old_name: str, dest: str
) -> None:
    parser = run.build_parser()
    assert getattr(parser.parse_args([vllm_name, "64"]), dest) == 64
    assert getattr(parser.parse_args([old_name, "64"]), dest) == 64
