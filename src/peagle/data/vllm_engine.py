"""The target served by vLLM, as a generation engine for self-distillation.

`VLLMEngine` starts `integrations/vllm/runner.py --serve` once in a vLLM environment's interpreter (`peagle.integrations.vllm.process`) and
keeps it for every batch, so the engine's start-up (tens of seconds on a CPU) is paid once.  Pass it where
[`self_distill`] and [`synthesize_prompts`] take the target: they hand it whole batches, which vLLM runs with
continuous batching (a finished sequence frees its slot at once, where `generate()` pads every row of a batch to
its longest continuation).  Same prompts, same decoding settings, same example format; greedy responses equal
transformers' wherever the two backends' kernels round alike (the interop suite checks fp32).

    with VLLMEngine(default_target_path()) as engine:   # needs a vLLM environment: see the interop suite
        rows = self_distill(engine, prompts, tokenizer=tokenizer)

Sampling is seeded per prompt (`seed` and the prompt's index), so a sampled batch is reproducible, but the
sampled text differs from transformers' for the same seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..integrations.vllm.process import VLLM_RUNNER, vllm_environ, vllm_python


class VLLMEngine:
    """A vLLM process serving `target` (a local model folder) for batched generation.

    Args:
        target: the model folder vLLM loads (for the default target, `peagle.targets.default_target_path()`).
        python: the vLLM environment's interpreter (default `$PEAGLE_VLLM_PYTHON`).
        dtype: the weights' dtype in vLLM (`"bfloat16"`, `"float32"`).
        max_model_len: longest prompt + continuation (default the target's `max_position_embeddings`, at most
            8192; the KV cache is paged, so a long window costs nothing until a sequence fills it).
        kv_cache_gib: the CPU KV cache (`VLLM_CPU_KVCACHE_SPACE`, unless set in the environment).
        chunk_size: prompts per request to the process (one progress-bar step each); vLLM batches them
            continuously inside a request.

    The attributes `config` and `generation_config` are the target's (read with transformers from `target`), so
    the stop ids are found as for a transformers target.  Use it as a context manager, or call `close()`.
    """

    continuous_batching = True
    """Marks the engines `generate_responses` hands a whole prompt list to (the protocol `distill` reads)."""

    def __init__(
        self,
        target: str | os.PathLike,
        *,
        python: str | os.PathLike | None = None,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        kv_cache_gib: int = 2,
        chunk_size: int = 64,
    ) -> None:
        from transformers import AutoConfig, GenerationConfig

        self._proc: subprocess.Popen | None = None
        self.target = Path(target)
        if not (self.target / "config.json").is_file():
            raise ValueError(
                f"{target} is not a model folder with a config.json: vLLM serves local folders here."
            )
        self.config = AutoConfig.from_pretrained(self.target)
        try:
            self.generation_config = GenerationConfig.from_pretrained(self.target)
        except OSError:
            self.generation_config = GenerationConfig.from_model_config(self.config)
        self.chunk_size = int(chunk_size)
        if max_model_len is None:
            max_model_len = min(int(getattr(self.config, "max_position_embeddings", 0) or 2048), 8192)
        self.max_model_len = int(max_model_len)
        python = vllm_python(python)
        fd, log = tempfile.mkstemp(prefix="peagle-vllm-engine-", suffix=".log")
        self._log = Path(log)  # the process's stderr, quoted when it fails
        with os.fdopen(fd, "w") as stderr:
            self._proc = subprocess.Popen(
                [str(python), str(VLLM_RUNNER), "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=vllm_environ(kv_cache_gib),
                cwd=tempfile.gettempdir(),
            )
        setup = {"target": str(self.target.resolve()), "dtype": dtype, "max_model_len": self.max_model_len}
        self._send(setup, expect="READY")

    # ------------------------------------------------------------------------------------------ process
    def _send(self, message: dict, expect: str = "RESULT") -> str:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError(f"the vLLM engine is not running.{self._log_tail()}")
        self._proc.stdin.write(json.dumps(message) + "\n")
        self._proc.stdin.flush()
        for line in self._proc.stdout:  # vLLM logs to stdout too: skip to the answer
            if line.startswith(expect):
                return line[len(expect) :].strip()
        raise RuntimeError(f"the vLLM engine stopped (exit {self._proc.wait()}).{self._log_tail()}")

    def _log_tail(self, lines: int = 30) -> str:
        text = self._log.read_text(errors="replace").splitlines()[-lines:]
        return ("\nIts log ends:\n" + "\n".join(text)) if text else ""

    def close(self) -> None:
        """Shut the vLLM process down (idempotent)."""
        if self._proc is not None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
            self._proc = None
            self._log.unlink(missing_ok=True)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None:
            self.close()

    # --------------------------------------------------------------------------------------- generation
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
        progress: bool = True,
        desc: str = "generating",
    ) -> list[list[int]]:
        """Continue each prompt (token ids): greedy, or sampled with `temperature`/`top_p`, seeded per prompt.

        Returns one list of new ids per prompt, in input order, each ending at and including its first stop id
        when it stopped on one (as [`generate_responses`] does).
        """
        from tqdm.auto import tqdm

        from .distill import through_first_stop

        stops = [int(t) for t in stop_token_ids]
        prompts = [list(map(int, p)) for p in prompts]
        for i, p in enumerate(prompts):  # every prompt is checked before any is generated
            if not p:
                raise ValueError(f"prompt {i} is empty.")
            if len(p) + max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt {i} ({len(p)} tokens) + max_new_tokens {max_new_tokens} exceeds the "
                    f"engine's max_model_len {self.max_model_len}."
                )
        outputs: list[list[int]] = []
        bar = tqdm(total=len(prompts), desc=f"{desc} (vLLM)", unit="prompt", disable=not progress)
        made = 0
        for start in range(0, len(prompts), self.chunk_size):
            chunk = prompts[start : start + self.chunk_size]
            request = {
                "prompts": chunk,
                "max_tokens": int(max_new_tokens),
                "temperature": float(temperature) if do_sample else 0.0,
                "top_p": float(top_p) if do_sample else 1.0,
                "seeds": [seed * 1_000_003 + start + i for i in range(len(chunk))] if do_sample else None,
                "stop_token_ids": stops,
            }
            for new in json.loads(self._send(request))["outputs"]:
                outputs.append(through_first_stop(new, stops))
                made += len(outputs[-1])
            bar.update(len(chunk))
            bar.set_postfix(tokens=made)
        bar.close()
        return outputs


__all__ = ["VLLMEngine"]
