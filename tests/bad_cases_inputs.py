"""Bad-input corpus rows: inputs, i.e. recipes, data files and the Hub (see tests/bad_input.py)."""

from __future__ import annotations

import io
import json
from typing import Any

import yaml

from bad_input import Case, Outcome, Workspace, untouched
from hub_server import ALICE_TOKEN, client_env

# -- helpers ------------------------------------------------------------------------------------


_untouched = untouched  # nothing written: inputs as they were, no output, no leftovers


def _merge_with(ws: Workspace, **changes: Any) -> list[str]:
    """The vanilla merge of ./a and ./b with top-level sections replaced (``evaluate`` included)."""
    body = yaml.safe_load(ws.merge_recipe().read_text(encoding="utf-8"))
    body.update(changes)
    recipe = ws.recipe(body)
    ws.snapshot()
    return [str(recipe)]


def _eval_data(ws: Workspace, data: dict[str, Any], task: str = "causal-lm") -> list[str]:
    """A merge of ./a and ./b evaluated on ``data``."""
    return _merge_with(ws, evaluate={"task": task, "data": data, "points": 3})


# -- recipes ------------------------------------------------------------------------------------


def _alias_bomb(ws: Workspace) -> list[str]:
    ws.merge_recipe()
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    text = (ws.root / "recipe.yaml").read_text(encoding="utf-8") + "\n".join(lines) + "\n"
    recipe = ws.recipe(text)
    ws.snapshot()
    return [str(recipe)]


def _python_tag(ws: Workspace) -> list[str]:
    ws.merge_recipe()
    text = (ws.root / "recipe.yaml").read_text(encoding="utf-8")
    text = text.replace("strategy: vanilla", "strategy: !!python/object/apply:os.system ['echo pwned > pwned']")
    recipe = ws.recipe(text)
    ws.snapshot()
    return [str(recipe)]


def _points_huge(ws: Workspace) -> list[str]:
    ws.text()
    data = {"dataset": "text", "data_files": "corpus.txt"}
    return _merge_with(ws, evaluate={"task": "causal-lm", "data": data, "points": 1_000_000_000})


def _model(ws: Workspace, ref: str) -> list[str]:
    return _merge_with(ws, models=[ref, "./b"])


def _zoo(ws: Workspace, *extra: str) -> list[str]:
    return [*_merge_with(ws, models=["zoo:gpt2-seed99999999999999999999", "./b"]), *extra]


def _set_option(value: str) -> Any:
    def build(ws: Workspace) -> list[str]:
        ws.model("a", seed=0)
        ws.model("b", seed=1)
        ws.snapshot()
        return ["align", "./a", "./b", "--strategy", "weight-matching", "--set", value]

    return build


# -- data files ---------------------------------------------------------------------------------


def _corpus(body: bytes) -> Any:
    def build(ws: Workspace) -> list[str]:
        ws.write("corpus.txt", body)
        return _eval_data(ws, {"dataset": "text", "data_files": "corpus.txt"})

    return build


def _block_past_context(ws: Workspace) -> list[str]:
    ws.text()
    return _eval_data(ws, {"dataset": "text", "data_files": "corpus.txt", "block_size": 100_000})


def _learned_sampler(ws: Workspace) -> list[str]:
    ws.text()
    strategy = {"name": "generalized-orthogonal", "learned": True, "sampler": "uniform(0.7, 0.2)"}
    return _merge_with(ws, strategy=strategy, data={"dataset": "text", "data_files": "corpus.txt"})


def _per_sublayer_merge(ws: Workspace) -> list[str]:
    return _merge_with(ws, strategy={"name": "transfusion", "residual_maps": "per-sublayer"})


def _jsonl(ws: Workspace) -> list[str]:
    good = json.dumps({"text": "to be, or not to be, that is the question"})
    ws.write("data.jsonl", "\n".join([good, good, '{"text": "unterminated', good]) + "\n")
    return _eval_data(ws, {"dataset": "json", "data_files": "data.jsonl"})


def _vit_images(ws: Workspace, bad: bytes) -> list[str]:
    import transformers as T
    from PIL import Image

    processor = T.ViTImageProcessor(size={"height": 8, "width": 8}, image_mean=[0.5], image_std=[0.5])
    for name, seed in (("a", 0), ("b", 1)):
        processor.save_pretrained(str(ws.model(name, kind="vit", seed=seed)))
    for i in range(4):
        buf = io.BytesIO()
        Image.new("L", (8, 8), color=i * 40).save(buf, format="PNG")
        ws.write(f"images/{i % 2}/{i}.png", buf.getvalue())
    ws.write("images/1/bad.png", bad)
    return _merge_with(
        ws,
        evaluate={
            "task": "image-classification",
            "data": {"dataset": "imagefolder", "data_dir": "images"},
            "points": 3,
            "compare": [],
        },
    )


def _corrupt_png(ws: Workspace) -> list[str]:
    buf = io.BytesIO()
    from PIL import Image

    Image.new("L", (8, 8)).save(buf, format="PNG")
    data = buf.getvalue()
    return _vit_images(ws, data[:40] + b"\x00garbage" * 4)


def _bomb_png(ws: Workspace) -> list[str]:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, format="PNG", optimize=True)  # 400 Mpixel, ~50 KB on disk
    return _vit_images(ws, buf.getvalue())


# -- paths the file system refuses --------------------------------------------------------------

LONG = "x" * 300  # one name past every common file system's 255 bytes: ENAMETOOLONG
TOO_LONG = "longer than the file system allows"


def _cli(*argv: str, models: tuple[str, ...] = ()) -> Any:
    """A command on the given argv, with tiny models built first."""

    def build(ws: Workspace) -> list[str]:
        for seed, name in enumerate(models):
            ws.model(name, seed=seed)
        ws.snapshot()
        return list(argv)

    return build


def _long_recipe_model(ref: str, *extra: str) -> Any:
    """A merge whose second model is ``ref`` (a path the file system refuses)."""
    return lambda ws: [*_merge_with(ws, models=["./a", ref]), *extra]


def _long_dataset(ws: Workspace) -> list[str]:
    return _eval_data(ws, {"dataset": f"./{LONG}"})


def _adapter_of_hub_base(ws: Workspace) -> list[str]:
    """``lineage a adapter`` where the adapter's base is a Hub id not in the (empty, offline) cache."""
    ws.model("a")
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["c_fc"], "fan_in_fan_out": True}
    ws.write("adapter/adapter_config.json", json.dumps({**config, "base_model_name_or_path": "someorg/somebase"}))
    ws.write("adapter/adapter_model.safetensors", b"")
    ws.snapshot()
    return ["lineage", "./a", "./adapter"]


def _named_once(ws: Workspace, result: Outcome) -> None:
    """The field once, at the start (it was ``MODEL 2: MODEL 2: … could not be read: MODEL 2: …``)."""
    _untouched(ws, result)
    assert result.err.count("MODEL 2") == 1, result.err


# -- the Hub (a local server: `Case.hub`) ------------------------------------------------------

SECRET = "hf_bad_input_secret_token_0123456789"


def _hub_env(ws: Workspace, token: str = ALICE_TOKEN, **extra: str) -> None:
    """The CLI talks to ``ws.hub`` with ``token``, downloads allowed, caches inside the case."""
    env = client_env(ws.hub, token, ws.root)
    ws.env.update({k: v for k, v in env.items() if k.startswith(("HF_", "NO_PROXY", "no_proxy"))})
    ws.env.update(
        HF_HUB_OFFLINE="0",
        TRANSFORMERS_OFFLINE="0",
        HF_HUB_CACHE=str(ws.root / "hf-home" / "hub"),  # under hf-home: not an input `ws.unchanged` tracks
        HF_XET_CACHE=str(ws.root / "hf-home" / "xet"),
        HF_REBASIN_HUB_TIMEOUT="1",
        **extra,
    )


def _hub_models(ws: Workspace, *extra: str, advertise: dict[str, int] | None = None) -> list[str]:
    """alice/gpt2-a and alice/gpt2-b on the local Hub (b advertising ``advertise``), merged by id."""
    for name, seed in (("a", 0), ("b", 1)):
        ws.hub.create_repo(f"alice/gpt2-{name}")
        ws.hub.add_commit(f"alice/gpt2-{name}", ws.model(f"hub-{name}", seed=seed))
    if advertise:
        ws.hub.advertise("alice/gpt2-b", advertise)
    _hub_env(ws)
    return [*_merge_with(ws, models=["alice/gpt2-a", "alice/gpt2-b"]), *extra]


def _nothing_downloaded(ws: Workspace, result: Outcome) -> None:
    _untouched(ws, result)
    assert not [p for m, p in ws.hub.requests if "/resolve/" in p], ws.hub.requests


def _hang_info(ws: Workspace) -> list[str]:
    argv = _hub_models(ws)
    ws.hub.hang_next("info", times=20)
    return argv


def _push(ws: Workspace, token: str = ALICE_TOKEN) -> list[str]:
    """A local merge pushed to alice/merged."""
    _hub_env(ws, token)
    return _merge_with(ws, output={"dir": "out", "push_to_hub": {"repo": "alice/merged"}})


def _push_hangs(ws: Workspace) -> list[str]:
    argv = _push(ws)
    ws.hub.hang_next("commit", times=20)
    return argv


def _push_garbled(ws: Workspace) -> list[str]:
    argv = _push(ws)
    ws.hub.garble_next("commit", times=20)
    return argv


def _push_kept(ws: Workspace, result: Outcome) -> None:
    """The result folder is complete and the retry command is printed."""
    ws.unchanged(allow_new=("out/",))
    assert (ws.root / "out" / "model.safetensors").is_file() and (ws.root / "out" / "rebasin.json").is_file()
    assert "hf-rebasin push " in result.err and "--repo alice/merged" in result.err
    assert not ws.leftovers(), ws.leftovers()


def _secret_kept(ws: Workspace, result: Outcome) -> None:
    _push_kept(ws, result)
    written = "".join(p.read_text(errors="ignore") for p in (ws.root / "out").iterdir() if p.is_file())
    assert SECRET not in result.stdout + result.stderr + written


# -- tokenizers and the offline cache ------------------------------------------------------------


def _other_tokenizer(ws: Workspace, *extra: str, **changes: Any) -> list[str]:
    """./a and ./b whose tokenizers differ: B's vocabulary has '!' and 'x' (ids shift from "'" on)."""
    from bad_input import TEXT
    from hf_rebasin.evaluation.data import char_tokenizer

    ws.model("a", seed=0)
    ws.model("b", seed=1)
    char_tokenizer(TEXT + "x!").save_pretrained(str(ws.root / "b"))
    return [*_merge_with(ws, **changes), *extra]


def _tokenizers_noted(ws: Workspace, result: Outcome) -> None:
    """The run went ahead and says so: rebasin.json's notes and the card name the difference."""
    ws.unchanged(allow_new=("out/",))
    record = json.loads((ws.root / "out" / "rebasin.json").read_text(encoding="utf-8"))
    assert any("tokenizers differ" in n and "is id 5" in n for n in record["notes"]), record["notes"]
    card = (ws.root / "out" / "README.md").read_text(encoding="utf-8")
    assert "tokenizers differ" in card and "allow_different_tokenizers: true" in card


def _offline_uncached(ws: Workspace) -> list[str]:
    """A Hub id that the (empty) local cache does not hold, with HF_HUB_OFFLINE=1."""
    return _merge_with(ws, models=["alice/never-downloaded@v1", "./b"])


def _bomb_warning_png(ws: Workspace) -> list[str]:
    """Past PIL's warning size (89 Mpixel) and under its error size: a warning only, unless made one."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (12000, 12000)).save(buf, format="PNG", optimize=True)
    return _vit_images(ws, buf.getvalue())


CASES: list[Case] = [
    Case(
        "path-too-long-verify",
        "paths",
        _cli("verify", LONG),
        2,
        needles=("MODEL:", TOO_LONG, "300 bytes"),
        check=_untouched,
        before="exit 1, internal error OSError: [Errno 36] File name too long",
    ),
    Case(
        "path-too-long-lineage",
        "paths",
        _cli("lineage", "./a", LONG, models=("a",)),
        2,
        needles=("MODEL 2:", TOO_LONG),
        check=_untouched,
        before="exit 1, internal error OSError: [Errno 36] File name too long",
    ),
    Case(
        "path-too-long-push",
        "paths",
        _cli("push", LONG, "--repo", "alice/merged"),
        2,
        needles=("FOLDER:", TOO_LONG),
        check=_untouched,
        before="exit 1, internal error OSError: [Errno 36] File name too long",
    ),
    Case(
        "path-through-a-file-lineage",
        "paths",
        _cli("lineage", "./a", "./a/config.json/x", models=("a",)),
        2,
        needles=("MODEL 2:", "'a/config.json' is a file, not a folder"),
        check=_untouched,
        before="exit 2, but said the folder does not exist",
    ),
    Case(
        "path-too-long-recipe-model",
        "paths",
        _long_recipe_model(f"./{LONG}"),
        2,
        needles=("models.1.model", TOO_LONG),
        check=_untouched,
        before="exit 1, internal error OSError: [Errno 36] File name too long",
    ),
    Case(
        "path-too-long-recipe-model-dry-run",
        "paths",
        _long_recipe_model(f"./{LONG}", "--dry-run"),
        2,
        needles=("models.1.model", TOO_LONG),
        check=_untouched,
        before="exit 1, internal error OSError: [Errno 36] File name too long",
    ),
    Case(
        "name-too-long-recipe-model-dry-run",
        "paths",
        _long_recipe_model(LONG, "--dry-run"),
        2,
        needles=("models.1.model", "nor a valid Hub repo id"),
        check=_untouched,
        before="exit 1, internal error OSError: [Errno 36] File name too long (looking for a folder of that name)",
    ),
    Case(
        "path-too-long-output-dir",
        "paths",
        lambda ws: _merge_with(ws, output={"dir": LONG}),
        2,
        needles=("output.dir", "is too long", "choose a shorter name"),
        check=_untouched,
    ),
    Case(
        "path-too-long-data-file",
        "paths",
        lambda ws: _eval_data(ws, {"dataset": "text", "data_files": LONG}),
        2,
        needles=("evaluate.data", "data file", TOO_LONG),
        check=_untouched,
        before="exit 1, internal error OSError: [Errno 36] File name too long",
    ),
    Case(
        "path-too-long-data-dir-dry-run",
        "paths",
        lambda ws: [*_eval_data(ws, {"dataset": "text", "data_dir": LONG}), "--dry-run"],
        2,
        needles=("evaluate.data", "data_dir", TOO_LONG),
        check=_untouched,
        before="exit 1, internal error OSError: [Errno 36] File name too long",
    ),
    Case(
        "path-too-long-dataset-folder",
        "paths",
        _long_dataset,
        2,
        needles=("evaluate.data", "dataset", TOO_LONG),
        check=_untouched,
        before="exit 1, internal error OSError: [Errno 36] File name too long (the dry run passes it: not checked)",
    ),
    Case(
        "lineage-adapter-hub-base-named-once",
        "paths",
        _adapter_of_hub_base,
        2,
        needles=("MODEL 2: 'adapter' is a PEFT LoRA adapter", "'someorg/somebase@main' is not in the local"),
        check=_named_once,
        before="exit 2, 'MODEL 2: MODEL 2: …' and the field a third time inside",
    ),
    Case(
        "tokenizers-differ",
        "recipe",
        _other_tokenizer,
        2,
        needles=("models.1.model", 'token "\'" is id 5 in `models.0.model` but 6', "allow_different_tokenizers"),
        check=_untouched,
        before="exit 0: merged silently; the card looked normal",
    ),
    Case(
        "tokenizers-differ-dry-run",
        "recipe",
        lambda ws: _other_tokenizer(ws, "--dry-run"),
        2,
        needles=("models.1.model", "is id 5", "allow_different_tokenizers"),
        check=_untouched,
        before="exit 0: planned as if the models matched",
    ),
    Case(
        "tokenizers-differ-allowed",
        "recipe",
        lambda ws: _other_tokenizer(ws, allow_different_tokenizers=True),
        0,
        check=_tokenizers_noted,
        before="exit 2: `allow_different_tokenizers` was not a recipe key",
    ),
    Case(
        "hub-offline-not-cached",
        "hub",
        _offline_uncached,
        2,
        needles=("models.0.model", "alice/never-downloaded@v1", "local Hugging Face cache", "HF_HUB_OFFLINE=0"),
        check=_untouched,
        before="exit 2, but without naming the cache or how to fill it",
        subprocess=True,
    ),
    Case(
        "yaml-alias-bomb",
        "recipe",
        _alias_bomb,
        2,
        needles=("recipe.yaml", "alias"),
        check=_untouched,
        before="still running after 15 s (stopped; the issue saw 57 s, then MemoryError): aliases expanded downstream",
        timeout=30,
    ),
    Case(
        "yaml-python-tag",
        "recipe",
        _python_tag,
        2,
        needles=("recipe.yaml", "YAML"),
        check=_untouched,
    ),
    Case(
        "evaluate-points-huge",
        "recipe",
        _points_huge,
        2,
        needles=("evaluate.points", "1001"),
        check=_untouched,
        before="validated; the run loaded everything, then evaluated for > 20 s (killed)",
    ),
    Case(
        "model-url",
        "recipe",
        lambda ws: _model(ws, "https://huggingface.co/gpt2"),
        2,
        needles=("models.0.model",),
        check=_untouched,
        before="exit 1, internal error HFValidationError (repo id must be in the form ...)",
    ),
    Case(
        "model-dot-dot",
        "recipe",
        lambda ws: _model(ws, "a..b"),
        2,
        needles=("models.0.model",),
        check=_untouched,
        before="exit 1, internal error HFValidationError (cannot have -- or .. in repo_id)",
    ),
    Case(
        "model-extra-slash",
        "recipe",
        lambda ws: _model(ws, "org/name/extra"),
        2,
        needles=("models.0.model",),
        check=_untouched,
        before="exit 1, internal error HFValidationError (repo id must be in the form ...)",
    ),
    Case(
        "zoo-seed-overflow",
        "recipe",
        _zoo,
        2,
        needles=("models.0.model", "seed"),
        check=_untouched,
        before="exit 1, internal error ValueError: Overflow when unpacking long long (torch.manual_seed)",
    ),
    Case(
        "zoo-seed-overflow-dry-run",
        "recipe",
        lambda ws: _zoo(ws, "--dry-run"),
        2,
        needles=("models.0.model", "seed"),
        check=_untouched,
        before="exit 0: the dry run planned a zoo model the run cannot train",
    ),
    Case(
        "align-set-unclosed",
        "recipe",
        _set_option("max_iter=[1,"),
        2,
        needles=("--set", "max_iter"),
        check=_untouched,
        before="exit 1, internal error ParserError (YAML of the --set value)",
    ),
    Case(
        "align-set-not-scalar",
        "recipe",
        _set_option("max_iter=!!binary aGVsbG8="),
        2,
        needles=("--set", "max_iter"),
        check=_untouched,
        before="exit 2, but the message named strategy.max_iter, not --set, and blamed the integer parse",
    ),
    Case(
        "corpus-empty",
        "data",
        _corpus(b""),
        2,
        needles=("corpus.txt",),
        check=_untouched,
        before="exit 1, internal error DatasetGenerationError",
    ),
    Case(
        "corpus-nul-bytes",
        "data",
        _corpus(b"to be or not\x00\x00 to be\n" * 20),
        2,
        needles=("corpus.txt",),
        check=_untouched,
        before="exit 0: the NUL bytes were tokenized and evaluated as text",
    ),
    Case(
        "corpus-binary",
        "data",
        _corpus(bytes(range(128, 256)) * 40),
        2,
        needles=("corpus.txt",),
        check=_untouched,
        before="exit 1, internal error DatasetGenerationError (UnicodeDecodeError)",
    ),
    Case(
        "block-size-past-context",
        "data",
        _block_past_context,
        2,
        needles=("evaluate.data.block_size", "100000", "positions"),
        check=_untouched,
        before="new option: the model would have been asked for positions it does not have",
    ),
    Case(
        "learned-sampler-empty-range",
        "recipe",
        _learned_sampler,
        2,
        needles=("strategy.sampler", "uniform(0.7, 0.2)", "must not be empty"),
        check=_untouched,
        before="new option: λ is drawn from the range, which must lie in [0, 1] and not be empty",
    ),
    Case(
        "per-sublayer-maps-in-a-merge",
        "recipe",
        _per_sublayer_merge,
        2,
        needles=("strategy", "residual_maps: per-sublayer", "job: transport", "merge needs one residual map"),
        check=_untouched,
        before="new option: per-sublayer maps change B's function, so a merge with them would be broken",
    ),
    Case(
        "jsonl-malformed-line",
        "data",
        _jsonl,
        2,
        needles=("data.jsonl",),
        check=_untouched,
        before="exit 1, internal error DatasetGenerationError",
    ),
    Case(
        "image-corrupt-png",
        "data",
        _corrupt_png,
        2,
        needles=("bad.png",),
        check=_untouched,
        before="exit 1, internal error UnidentifiedImageError",
    ),
    Case(
        "image-decompression-bomb-warning",
        "data",
        _bomb_warning_png,
        2,
        needles=("bad.png", "decompression bomb"),
        check=_untouched,
        before="exit 0: PIL only warned, and a 144 Mpixel image was decoded and resized",
    ),
    Case(
        "image-decompression-bomb",
        "data",
        _bomb_png,
        2,
        needles=("bad.png",),
        check=_untouched,
        before="exit 1, internal error DecompressionBombError",
    ),
    Case(
        "hub-metadata-never-answers",
        "hub",
        _hang_info,
        2,
        needles=("models.0.model", "did not answer", "HF_REBASIN_HUB_TIMEOUT"),
        check=_untouched,
        before="hung: no answer after 30 s (the client waits forever)",
        hub=True,
        timeout=30,
        slow=True,  # waits out a Hub timeout
    ),
    Case(
        "hub-upload-never-answers",
        "hub",
        _push_hangs,
        2,
        needles=("output.push_to_hub", "did not answer", "The result is kept in"),
        check=_push_kept,
        before="hung: no answer after 40 s (the client waits forever)",
        hub=True,
        timeout=40,
        slow=True,  # waits out a Hub timeout
    ),
    Case(
        "hub-push-garbled-answer",
        "hub",
        _push_garbled,
        2,
        needles=("output.push_to_hub", "The result is kept in"),
        check=_push_kept,
        before="exit 1, internal error UnicodeDecodeError from the client; no retry command",
        hub=True,
        slow=True,  # a whole merge, then a push (7 s)
    ),
    Case(
        "hub-token-never-printed",
        "hub",
        lambda ws: _push(ws, SECRET),
        2,
        needles=("rejected the token", "The result is kept in"),
        check=_secret_kept,
        hub=True,
        slow=True,  # a whole merge, then a push (8 s)
    ),
    Case(
        "hub-sibling-dot-dot",
        "hub",
        lambda ws: _hub_models(ws, advertise={"config.json/../x": 10, "../../evil.json": 10}),
        2,
        needles=("models.1.model", "/../", "outside the repository"),
        check=_nothing_downloaded,
        before="exit 0: the repo was used although it lists files outside itself",
        hub=True,
    ),
    Case(
        "hub-config-advertised-huge",
        "hub",
        lambda ws: _hub_models(ws, "--dry-run", advertise={"config.json": 10 << 30}),
        2,
        needles=("models.1.model", "config.json", "refusing to download"),
        check=_nothing_downloaded,
        before="exit 0: a 10 GiB config.json was planned for download",
        hub=True,
    ),
    Case(
        "hub-weights-far-larger-than-config",
        "hub",
        lambda ws: _hub_models(ws, advertise={"model.safetensors": 3 << 30}),
        2,
        needles=("models.1.model", "parameters", "refusing to download"),
        check=_untouched,
        before="exit 0: 3 GiB of weights for a tiny config were accepted for download",
        hub=True,
    ),
]
