"""lm-eval-harness model "delta_jax": any model `load_model` reads, scored with delta_jax.scoring.

    python -m delta_jax.lm_eval_adapter --model delta_jax \\
        --model_args pretrained=PATH,tokenizer=qwen3,max_length=2048 --batch_size 8 \\
        --tasks hellaswag

runs lm-eval's own command line (__main__.py) with this model registered (plain `lm_eval` does
not import it). `data=D,fsdp=F,tensor=T` in --model_args (any of them) load the model onto that
device mesh, as --mesh D,F,T of the other tools (one size may be -1: the devices left). From Python:
`lm_eval.simple_evaluate(model=DeltaJaxLM(pretrained=PATH), tasks=[...])`. Requires
`pip install lm_eval==0.4.13`.
"""
from __future__ import annotations

import collections

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from delta_jax.generate import Sampling, generate
from delta_jax.loading import load_model, load_tokenizer
from delta_jax.scoring import encode_pair, loglikelihood
from delta_jax.sharding import make_hybrid_mesh


@register_model("delta_jax")
class DeltaJaxLM(LM):
    def __init__(self, pretrained: str, tokenizer: str | None = None, batch_size: int | str = 8,
                 max_length: int | str = 2048, dtype: str | None = None,
                 data: int | str | None = None, fsdp: int | str | None = None,
                 tensor: int | str | None = None, **harness_options):
        # harness_options: what lm-eval passes to every model (device, max_batch_size, ...).
        super().__init__()
        sizes = (data, fsdp, tensor)  # within each slice; the slices go on data
        mesh = (None if sizes == (None, None, None) else
                make_hybrid_mesh([1 if n is None else int(n) for n in sizes]))
        self.model = load_model(pretrained, mesh=mesh, **({"dtype": dtype} if dtype else {}))
        self.tokenizer = load_tokenizer(pretrained, tokenizer)
        if self.tokenizer is None:
            raise ValueError(f"{pretrained}: lm-eval needs a tokenizer; pass tokenizer=byte, "
                             "qwen3 or a tokenizer.json path in --model_args")
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)

    def _loglikelihood_tokens(self, pairs):
        return loglikelihood(self.model, pairs, max_length=self.max_length,
                             batch_size=self.batch_size)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self._loglikelihood_tokens(
            [encode_pair(self.tokenizer, *request.args) for request in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Each document scored whole, in windows of max_length after an EOS prefix token."""
        windows, owner = [], []
        for i, request in enumerate(requests):
            tokens = self.tokenizer.encode(request.args[0])
            for window in get_rolling_token_windows(tokens, prefix_token=self.tokenizer.eos_id,
                                                    max_seq_len=self.max_length, context_len=1):
                windows.append(make_disjoint_window(window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests) -> list[str]:
        """Greedy (or, with do_sample, sampled) continuations cut at the first stop string;
        requests with the same generation arguments run in batches."""
        groups = collections.defaultdict(list)
        for i, request in enumerate(requests):
            groups[repr(sorted(request.args[1].items()))].append(i)
        out = [""] * len(requests)
        eos = self.tokenizer.eos_id
        for indices in groups.values():
            kwargs = requests[indices[0]].args[1]
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new_tokens = int(kwargs.get("max_gen_toks", 256))
            sampling = (Sampling(temperature=float(kwargs.get("temperature", 1.0)))
                        if kwargs.get("do_sample") else Sampling(greedy=True))
            keep = max(self.max_length - new_tokens, 1)  # the prompt's last tokens
            for first in range(0, len(indices), self.batch_size):
                chunk = indices[first:first + self.batch_size]
                prompts = [self.tokenizer.encode(requests[i].args[0])[-keep:] or [eos]
                           for i in chunk]
                result = generate(self.model, prompts, max_new_tokens=new_tokens,
                                  sampling=sampling, eos_id=eos, pad_multiple=64)
                for row, i in enumerate(chunk):
                    text = self.tokenizer.decode([t for t in result.row(row) if t != eos])
                    for stop in until:
                        text = text.split(stop)[0]
                    out[i] = text
        return out
