"""What the memory holds and what it does, answered by the library instead of by hand (docs/analysis.md).

* `ngram_stats` (``stats``): per hash head over a corpus, the n-grams counted, how many distinct ones, the rows
  they hit against uniform hashing's expectation, the rows two n-grams share and the occurrences that collide.
* `row_ngrams` (``stats``): the n-grams of a corpus that land on given rows, most frequent first.
* `probe` (``probing``): every part of the layer's output for given hidden states and tokens.
* `table_diff` (``table``): the rows two tables differ most in, read block by block.
* `ablate` (``table``): the layer's lookups read zeros, their head's mean row or shuffled rows inside a block.
* `plot_gate` (``gates``): the gate of a `probe` per token and stream, the tokens as text.

Everything works on any backend's layer and, where it streams, in bounded memory; ``python -m ple analyze``
prints `ngram_stats` of a token file. The windows and rows come from the config through one function, so a
family's own window rule and hash are what is counted.
"""

from .gates import plot_gate, token_labels
from .probing import Probe, probe
from .stats import HeadStats, NgramStats, ngram_stats, row_ngrams
from .table import Ablation, TableDiff, ablate, head_means, table_diff

__all__ = ["ngram_stats", "row_ngrams", "NgramStats", "HeadStats", "probe", "Probe", "table_diff", "TableDiff",
           "ablate", "Ablation", "head_means", "plot_gate", "token_labels"]
