"""Real text, a tokenizer trained on it and a small model with a PLE layer trained on it: offline, in seconds.

What ``notebooks/06_what_the_memory_holds.ipynb`` studies with ``ple.analysis``. Three pieces:

* **text**: Python's own documentation as it ships with the interpreter, ``pydoc_data.topics.topics`` (the
  pages ``help("with")``, ``help("FORMATTING")``, ... print: 79 topics, ~465,000 characters of English
  prose with code examples, in CPython 3.11). It is part of CPython's standard library, so every machine
  that runs this package has it, offline, with no download. Each topic is cut at a paragraph break: its
  first nine tenths are a training document, the rest a held-out one; each document ends with EOS. The
  exact text (and every number derived from it) follows the Python version.
* **tokenizer**: a byte-level BPE (the GPT-2 scheme) trained on the training documents with the
  ``tokenizers`` library (the ``dev`` extra lists it; ``transformers`` depends on it too) in a fraction of a
  second. ``<eos>`` is token 0. 1,024 tokens by default: the text has only ~140,000 tokens of them, and
  with a larger vocabulary most 3-grams occur once, so the memory memorises instead of generalising (with
  2,048 tokens, after a few hundred steps, the model with the layer did worse on held-out text than its
  twin without).
* **model**: ``examples/train_tiny.py``'s ``TinyLM`` (token embedding -> PLE layer -> RMS norm -> linear
  head), imported from there, trained for next-token prediction on random windows of the training stream
  with its optimizers (the table in ``ple.optim.RowwiseAdagrad``, the rest in Adam) and its training step.
  Its only view of the tokens before the current one is the PLE layer's n-gram memory. 500 steps of
  16 x 128 tokens take about 30 s on one CPU thread.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import pathlib
import re
import sys
import time
from types import ModuleType
from typing import NamedTuple

import torch

import ple
from ple._progress import progress

EOS = "<eos>"


def _train_tiny() -> ModuleType:
    """``examples/train_tiny.py`` as a module (``examples/`` is not a package): the model and its training step."""
    name = "train_tiny"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


train_tiny = _train_tiny()
TinyLM = train_tiny.TinyLM


def documents() -> dict[str, str]:
    """The topics of Python's own documentation shipped with the interpreter: ``{name: text}``, sorted by name."""
    from pydoc_data.topics import topics

    return {name: topics[name] for name in sorted(topics)}


def train_tokenizer(texts: list[str], vocab_size: int = 1024):
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on ``texts``; ``<eos>`` is token 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


class Corpus(NamedTuple):
    """The tokenized documentation: the tokenizer and two lists of documents, each a 1-D id tensor ending in EOS."""

    tokenizer: object               # tokenizers.Tokenizer
    train: list[torch.Tensor]       # each topic's first part
    held_out: list[torch.Tensor]    # each topic's last paragraphs (about held_out of its text), where it has two
    names: list[str]                # the topics' names, in the order of train
    chars: int                      # characters of text in all

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.token_to_id(EOS)

    def stream(self, part: str = "train") -> torch.Tensor:
        """The documents of ``part`` ("train" or "held_out") packed into one 1-D stream."""
        return torch.cat(getattr(self, part))

    def encode(self, text: str) -> torch.Tensor:
        """The ids of ``text`` (no EOS added), a 1-D int64 tensor."""
        return torch.tensor(self.tokenizer.encode(text).ids, dtype=torch.int64)

    def decode(self, ids) -> str:
        """The text of ``ids`` (EOS written as ``<eos>``)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def show(self, ids, sep: str = "|") -> str:
        """The tokens of ``ids`` as text, one by one, separated by ``sep``; newlines written as ``\\n``."""
        return sep.join(self.decode([i]).replace("\n", "\\n") for i in ids)


def split_topic(text: str, held_out: float) -> tuple[str, str]:
    """``text`` cut at the paragraph break nearest ``1 - held_out`` of its length: (first part, last part)."""
    target = len(text) * (1 - held_out)
    breaks = [m.start() for m in re.finditer("\n\n", text)] or [len(text)]
    cut = min(breaks, key=lambda i: abs(i - target))
    return text[:cut], text[cut:].lstrip("\n")


def build_corpus(vocab_size: int = 1024, held_out: float = 0.1) -> Corpus:
    """Python's documentation tokenized with a BPE trained on its training part (about half a second).

    Every topic is cut at a paragraph break: its first ``1 - held_out`` is a training document, the rest a
    held-out document (the tokenizer never sees it; its words and phrases are the topic's own, as a
    validation split's would be).
    """
    docs = documents()
    parts = {name: split_topic(text, held_out) for name, text in docs.items()}
    tokenizer = train_tokenizer([first for first, _ in parts.values()], vocab_size)
    eos = tokenizer.token_to_id(EOS)

    def ids(text: str) -> torch.Tensor:
        return torch.tensor(tokenizer.encode(text).ids + [eos], dtype=torch.int64)

    return Corpus(tokenizer, [ids(first) for first, _ in parts.values()],
                  [ids(last) for _, last in parts.values() if last], list(parts), sum(map(len, docs.values())))


def model_config(corpus: Corpus, *, hidden_size: int = 64, hc_count: int = 2, heads_per_ngram: int = 2,
                 ngram_size: int = 3, rows_per_head: int = 10_007) -> ple.PLEConfig:
    """The PLE layer of the model: ``heads_per_ngram`` heads per order 2..``ngram_size`` of ~``rows_per_head`` rows.

    With the defaults: 4 heads of ~10,000 rows of 16 numbers, fewer rows than the training text has distinct
    2-grams (~25,000) or 3-grams (~60,000), as the real model's table is smaller than the n-grams it sees.
    """
    return ple.PLEConfig(vocab_size=corpus.vocab_size, hidden_size=hidden_size, hc_count=hc_count,
                         ple_embed_dim=hidden_size, heads_per_ngram=heads_per_ngram, ngram_size=ngram_size,
                         ple_conv_kernel_size=2, ngram_vocab_size_base=rows_per_head,
                         make_ngram_vocab_size_divisible_by=16, eos_token_id=corpus.eos_token_id,
                         ple_layer_ids=[1])


def windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, length + 1]`` ids: windows of ``stream`` starting at random positions."""
    starts = torch.randint(0, len(stream) - length, (batch,), generator=gen)
    return stream[starts[:, None] + torch.arange(length + 1)]


def eval_windows(stream: torch.Tensor, length: int, max_windows: int | None = None) -> torch.Tensor:
    """``[windows, length + 1]``: ``stream`` cut into consecutive windows (overlapping by one token), in order."""
    count = (len(stream) - 1) // length
    if max_windows is not None:
        count = min(count, max_windows)
    starts = torch.arange(count) * length
    return stream[starts[:, None] + torch.arange(length + 1)]


@torch.no_grad()
def evaluate(model, x: torch.Tensor, batch: int = 64) -> float:
    """Mean next-token cross-entropy of ``model`` over the windows ``x`` (``[windows, length + 1]``)."""
    was_training = model.training
    model.eval()
    total = sum(float(train_tiny.next_token_loss(model, x[i:i + batch])) * len(x[i:i + batch])
                for i in range(0, len(x), batch))
    model.train(was_training)
    return total / len(x)


class Trained(NamedTuple):
    """What `train` returns."""

    model: object                   # TinyLM
    initial: object                 # the model's PLE layer before training (a copy), or None without one
    losses: list[float]             # training loss of each step
    seconds: float


def train(corpus: Corpus, config: ple.PLEConfig, *, steps: int, batch: int = 16, length: int = 128,
          use_ple: bool = True, backend: str = "torch", lr: float = 1e-2, table_lr: float = 0.03,
          seed: int = 0) -> Trained:
    """Train a ``TinyLM`` for next-token prediction on random windows of the training stream."""
    torch.manual_seed(seed)
    model = TinyLM(config, use_ple, backend)
    initial = copy.deepcopy(model.ple) if use_ple else None
    opts = train_tiny.optimizers(model, argparse.Namespace(table_optimizer="rowwise-adagrad", lr=lr,
                                                          table_lr=table_lr))
    gen = torch.Generator().manual_seed(seed + 1)
    stream = corpus.stream("train")
    t0 = time.perf_counter()
    losses = [train_tiny.train_step(model, opts, windows(stream, batch, length, gen))
              for _ in progress(range(steps), desc="with PLE" if use_ple else "without PLE")]
    return Trained(model, initial, losses, time.perf_counter() - t0)
