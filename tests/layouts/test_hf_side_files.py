"""A Hugging Face model folder verifies only when `from_pretrained` and `AutoTokenizer` load it: config.json
present, every JSON side file parsing (issue 31). Judged by transformers' own loads of the same damaged copy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult, copy_tree


@pytest.fixture(scope="module")
def model_with_tokenizer(hf_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's `save_pretrained` folder with a generation config of its own (`max_new_tokens`), and a
    word-level tokenizer's `save_pretrained` beside it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    folder = copy_tree(hf_model_dirs["single"], tmp_path_factory.mktemp("hf-tok") / "model")
    backend = Tokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "w3": 3}, unk_token="<unk>"))
    GenerationConfig(max_new_tokens=_MAX_NEW_TOKENS).save_pretrained(folder)
    backend.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)
    return folder


#: The saved generation config's own setting: transformers replaces an unreadable generation_config.json
#: with one made from the model config (`modeling_utils.PreTrainedModel.from_pretrained` catches the
#: OSError `GenerationConfig.from_pretrained` raises), so this value is what a damaged file silently loses.
_MAX_NEW_TOKENS = 7


def _framework_loads(folder: Path) -> str | None:
    """None when transformers loads the model (with its saved generation config) and the tokenizer from
    `folder`, else what failed or was lost."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(folder)
        AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # what the framework raises is the verdict, whatever its type
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if model.generation_config.max_new_tokens != _MAX_NEW_TOKENS:
        return "lost: the saved generation config"
    return None


def _delete(path: Path) -> None:
    path.unlink()


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("config.json", _delete),
        ("config.json", _truncate),
        ("tokenizer.json", _truncate),
        ("tokenizer_config.json", _truncate),
        ("generation_config.json", _truncate),
    ],
)
def test_a_side_file_transformers_cannot_read_fails_verify(
    model_with_tokenizer: Path,
    tmp_path: Path,
    run_cli: Callable[..., CliResult],
    name: str,
    damage: Callable[[Path], None],
) -> None:
    folder = copy_tree(model_with_tokenizer, tmp_path / "model")
    damage(folder / name)
    assert _framework_loads(folder) is not None  # the case is real: transformers' own load fails
    result = run_cli("verify", folder, "--json")
    assert result.exit_code == 1, result.stdout + result.stderr
    problems = result.json["problems"]
    assert name in {p["path"] for p in problems if p["severity"] == "error"}


def test_the_whole_folder_verifies_and_loads(model_with_tokenizer: Path, run_cli: Callable[..., CliResult]) -> None:
    assert _framework_loads(model_with_tokenizer) is None
    result = run_cli("verify", model_with_tokenizer, "--json")
    assert result.exit_code == 0, result.stdout + result.stderr


def test_bare_weights_need_no_config(
    hf_model_dirs: dict[str, Path], tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    """A folder of weights alone (a `save_file` output) is not a model folder that lost its config."""
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((hf_model_dirs["single"] / "model.safetensors").read_bytes())
    assert run_cli("verify", folder).exit_code == 0
