"""Calibration after transport: the fine-tune teaches the moved model what weight transport left behind.

Moving a task vector carries only part of what a fine-tune learned; a chat fine-tune moved that
way keeps the rows of its chat tokens but not *when* to use them. Here the fine-tune is the
teacher and no labels are needed: a small set of the moved model's parameters is fitted so that its
next-token distributions match the fine-tune's (KL(teacher ‖ student)) on calibration text, while a
guard term keeps it close to the target on text the target writes itself (KL(target ‖ student)),
so the moved model forgets no more than it must. Its modules, in the order a run uses them:

- `vocab`: which token of one model is which of another (calibration text is read by the
  teacher's tokenizer; the student and the target may number tokens otherwise);
- `text`: calibration text the fine-tune writes itself, through its chat template where it has
  one (a user turn started, the rest written by the model: no user data needed);
- `fit`: which parameters are fitted (new tokens' rows, norms and biases, a low-rank correction,
  everything, or an adapter's own factors) and how a correction is folded back into the weights;
- `distill`: the fitting loop, and the measures a card reports (KL, turn ends);
- `seq2seq`: the same for an encoder-decoder (T5, BART, mBART, Marian), which cannot write its own
  sources: from sources a caller reads from data, the fine-tune and the target write continuations,
  and the student is fitted over decoder positions given the source.

Pure torch on models a caller built; never reads a recipe or a file.
"""
