"""Models whose vocabularies differ: the output's vocabulary built, then the embedding rows mapped to it.

Hub relatives rarely share every token at every row (a chat fine-tune adds tokens, a release
extends the vocabulary, a checkpoint pads its embedding). mergekit keeps the subject in one package
(``tokenizer/``); so does this one. Its modules, in the order a run uses them:

- `files`: the tokenizer files through the gate, a tokenizer loaded, two tokenizers compared;
- `tokens`: a tokenizer's vocabulary (which row is which token), two vocabularies compared;
- `checks`: tokenizers and row counts checked before any weight is read (ids fit the embedding,
  every model means what the reference means), rows paired by position where nothing matches them;
- `layout`: the working row layout the models are loaded into (rows matched by token), the
  output's rows, a model reindexed;
- `output`: the run's vocabularies (`RunVocabulary`): the output's chosen (a job's
  `core.names.VocabularyChoice`), the models brought to the working rows (`to_rows`), the output's
  rows and tokenizer files written;
- `fill`: the rows a model lacks, filled in the common basis after alignment;
- `adapter_rows`, `adapter_tokens`: a LoRA adapter trained with new tokens, read as the fine-tune
  it makes, and written back as an adapter for the target.

Takes plain arguments (folders, names, flags, the choice), never a recipe. Imports `core`,
`symmetry`, `io`, `alignment` and `merging`.
"""
