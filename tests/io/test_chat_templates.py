"""Named chat templates (``additional_chat_templates/NAME.jinja``): read through the gate like every
other file a loader opens, and carried into the output, byte for byte, as stock transformers reads
them (``AutoTokenizer(...).chat_template`` is a dict of every template).

The oracle is the stock ``AutoTokenizer`` loading the input and the output folders, and the template
files' bytes read back from the output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers as T

from helpers import run_main
from hf_rebasin.io import gate, layout
from lm_folders import write_recipe
from vocab_models import CHATML, mergekit_cases, save_chat_transport, tiny_llama

DEFAULT = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
TOOL = "{% for t in tools %}{{ t.name }}{% endfor %}<|im_start|>assistant\n"


def _with_templates(folder: Path, tool: str = TOOL) -> Path:
    (folder / "chat_template.jinja").write_text(DEFAULT, encoding="utf-8")
    (folder / "additional_chat_templates").mkdir(exist_ok=True)
    (folder / "additional_chat_templates" / "tool.jinja").write_text(tool, encoding="utf-8")
    return folder


def _templates(folder: Path) -> object:
    return T.AutoTokenizer.from_pretrained(str(folder)).chat_template


def _transport(folders: dict[str, Path]) -> dict[str, object]:
    """The transport of a chat fine-tune of ``base`` onto ``target`` into ``out``."""
    roles = {"base": folders["base"], "finetuned": folders["ft"], "target": folders["target"]}
    body: dict[str, object] = {"job": "transport", **{k: str(v) for k, v in roles.items()}}
    return {**body, "strategy": "weight-matching", "calibrate": False, "output": {"dir": "out"}, "device": "cpu"}


def _run(root: Path, body: dict[str, object]) -> tuple[int, str]:
    done = run_main(str(write_recipe(root, body)), env={"HF_HUB_OFFLINE": "1", "HF_REBASIN_NO_CACHE": "1"})
    return done.returncode, done.stdout + done.stderr


def test_is_support_file_takes_named_templates_and_nothing_else_below() -> None:
    assert layout.is_support_file("additional_chat_templates/tool.jinja")
    for name in ("additional_chat_templates/tool.txt", "additional_chat_templates/a/b.jinja", "onnx/model.jinja"):
        assert not layout.is_support_file(name), name


def test_support_files_lists_the_named_templates_at_their_real_paths(tmp_path: Path) -> None:
    folder = _with_templates(mergekit_cases(tmp_path)["base"])
    found = gate.support_files(folder)
    assert found["additional_chat_templates/tool.jinja"] == (folder / "additional_chat_templates/tool.jinja").resolve()
    assert "chat_template.jinja" in found and "model.safetensors" not in found


@pytest.mark.parametrize("holder", ["base", "chatml"])
def test_a_union_merge_of_other_vocabularies_keeps_every_named_template(tmp_path: Path, holder: str) -> None:
    """The union is ``chatml``'s vocabulary, so the output has its tokenizer files as they are; the
    templates, whichever model holds them (``chatml``'s own, else the reference's), come along: the
    stock loader reads the same dict from the output as from the input, and the note says so."""
    cases = mergekit_cases(tmp_path / "cases")
    _with_templates(cases[holder])
    body = {
        "job": "merge",
        "models": [str(cases["base"]), str(cases["chatml"])],
        "strategy": "vanilla",
        "tokenizer": {"source": "union"},
        "output": {"dir": "out"},
        "device": "cpu",
    }
    code, err = _run(tmp_path, body)
    assert code == 0, err
    out = tmp_path / "out"
    want = _templates(cases[holder])
    assert isinstance(want, dict) and set(want) == {"default", "tool"}
    assert ("with the chat templates of" in " ".join(err.split())) == (holder == "base"), err
    assert _templates(out) == want
    assert (out / "additional_chat_templates" / "tool.jinja").read_text(encoding="utf-8").strip() == TOOL.strip()
    assert T.AutoTokenizer.from_pretrained(str(out)).convert_tokens_to_ids(CHATML[1]) == 65  # the union's rows


def test_a_merge_with_the_references_tokenizer_carries_the_templates_byte_for_byte(tmp_path: Path) -> None:
    cases = mergekit_cases(tmp_path / "cases")
    _with_templates(cases["base"])
    body = {"job": "merge", "models": [str(cases["base"]), str(cases["base"])], "strategy": "vanilla"}
    code, err = _run(tmp_path, {**body, "output": {"dir": "out"}, "device": "cpu"})
    assert code == 0, err
    src, out = cases["base"] / "additional_chat_templates", tmp_path / "out" / "additional_chat_templates"
    assert (out / "tool.jinja").read_bytes() == (src / "tool.jinja").read_bytes()
    assert _templates(tmp_path / "out") == _templates(cases["base"])


def test_a_transport_keeps_the_fine_tunes_named_templates(tmp_path: Path) -> None:
    """The fine-tune's tokenizer (ChatML tokens, its templates) is the output's: both templates come
    along, and none of the target's own named templates stays behind beside them."""
    ft = tiny_llama(64, 0)
    ft.resize_token_embeddings(66)
    folders = save_chat_transport(tmp_path, tiny_llama(64, 0), ft, tiny_llama(64, 7), [])
    _with_templates(folders["ft"])
    _with_templates(folders["target"], tool="TARGET'S OWN {{ tools }}")
    (folders["target"] / "additional_chat_templates" / "other.jinja").write_text("{{ x }}", encoding="utf-8")
    body = _transport(folders)
    code, err = _run(tmp_path, body)
    assert code == 0, err
    out = tmp_path / "out"
    assert _templates(out) == _templates(folders["ft"])
    assert sorted(p.name for p in (out / "additional_chat_templates").iterdir()) == ["tool.jinja"]


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_named_template_linked_out_of_the_fine_tune_is_refused_and_never_written(tmp_path: Path, what: str) -> None:
    """The leak: a fine-tune's ``additional_chat_templates/tool.jinja`` (or the whole folder) links to a
    file outside; the transport refuses it, writes nothing, and the outside bytes reach no file."""
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "tool.jinja").write_text("SECRET-BYTES-OUTSIDE-THE-MODEL", encoding="utf-8")
    ft = tiny_llama(64, 0)
    ft.resize_token_embeddings(66)
    folders = save_chat_transport(tmp_path / "m", tiny_llama(64, 0), ft, tiny_llama(64, 7), [])
    (folders["ft"] / "chat_template.jinja").write_text(DEFAULT, encoding="utf-8")
    if what == "file":
        (folders["ft"] / "additional_chat_templates").mkdir()
        (folders["ft"] / "additional_chat_templates" / "tool.jinja").symlink_to(secret / "tool.jinja")
    else:
        (folders["ft"] / "additional_chat_templates").symlink_to(secret)
    body = _transport(folders)
    for dry in (True, False):
        done = run_main(
            str(write_recipe(tmp_path, body)), *(["--dry-run"] if dry else []), env={"HF_REBASIN_NO_CACHE": "1"}
        )
        message = " ".join(done.stderr.split())
        assert done.returncode == 2, done.stderr
        assert "finetuned" in message and "additional_chat_templates/tool.jinja" in message, message
        assert "leads outside" in message, message
    assert not (tmp_path / "out").exists()
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink() and p.parent != secret]
    assert not [p for p in leaked if b"SECRET-BYTES" in p.read_bytes()]


def test_a_hub_download_takes_the_named_templates_and_bounds_their_size() -> None:
    """What a Hub repo gives: the templates' folder is fetched (it is what the loader reads), nothing
    else below the top level; a template advertised larger than any is refused before downloading."""
    from hf_rebasin.core.errors import RebasinUserError
    from hf_rebasin.io.hub import selection

    names = ["config.json", f"{layout.CHAT_TEMPLATE_DIR}/tool.jinja", f"{layout.CHAT_TEMPLATE_DIR}/a/b.jinja"]
    assert selection.support_names([*names, "onnx/tool.jinja"]) == names[:2]
    selection.check_file_sizes({names[1]: 4096}, "repo 'alice/chat'")
    with pytest.raises(RebasinUserError, match=r"tool\.jinja"):
        selection.check_file_sizes({names[1]: 17 << 20}, "repo 'alice/chat'")
