"""The leaderboard, rebuilt from the sources that ``leaderboards/sources.toml`` declares
(``python scripts/make_leaderboard.py``; :mod:`arckv_press.bench.make_leaderboard` composes the
parts):

- :mod:`.sources`: the manifest (every run folder, records file and CSV that feeds the leaderboard,
  the plots and every generated doc block), read and checked;
- :mod:`.readers`: lm-eval results, compaction records and the per-case CSVs (needle, continuation
  fidelity) to leaderboard rows, with the rows of superseded runs and of other checkpoints or
  compaction options filtered out by id;
- :mod:`.table`: the table's columns, keys, reference scores and CSV output;
- :mod:`.intervals`: per-example scores, 95% intervals and paired comparisons (on
  :mod:`arckv_press.bench.uncertainty`);
- :mod:`.plots`: the score-against-kept-fraction and score-against-time plots;
- :mod:`.doc_tables`: the README's headline and best-at-keep-10% blocks and the per-benchmark tables;
- :mod:`.doc_blocks`: the writer of generated blocks between marker lines in Markdown files.

None of these modules imports torch.
"""
