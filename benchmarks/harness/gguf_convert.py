"""llama.cpp's convert_hf_to_gguf.py for benchmarks/harness/model_dir.py's gpt2-small-bpe, with two fixes.

    python benchmarks/harness/gguf_convert.py LLAMA_CPP_DIR MODEL_DIR --outtype f32 --outfile OUT.gguf

Runs LLAMA_CPP_DIR/convert_hf_to_gguf.py unchanged, as a script, after patching two things in
memory (llama.cpp's files are not edited; benchmarks/peers/llamacpp.py calls this):
1. The BPE pre-tokenizer check. The converter names a tokenizer's pre-tokenizer by hashing the ids
   it gives a fixed string, against a table of known models. The benchmark's BPE is trained here
   (model_dir.py), so its hash is its own and the converter refuses it; its pre-tokenizer is
   tokenizers' ByteLevel with GPT-2's own regex, so "gpt-2" is the right name, used only when the
   table has no match.
2. `n_ctx`. The converter's GPT-2 reads `n_ctx` from config.json, which transformers 5 no longer
   writes (only `n_positions`): copied over when missing.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any


def main() -> None:
    llama = Path(sys.argv[1]).resolve()
    script = llama / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path[:0] = [str(llama), str(llama / "gguf-py")]

    import conversion.base as base  # type: ignore[import-not-found]
    import conversion.gpt2 as gpt2  # type: ignore[import-not-found]

    known_pre = base.TextModel.get_vocab_base_pre
    known_params = gpt2.GPT2Model.set_gguf_parameters

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        try:
            return str(known_pre(self, tokenizer))
        except NotImplementedError:
            base.logger.warning("pre-tokenizer hash unknown: using 'gpt-2' (ByteLevel, GPT-2's regex)")
            return "gpt-2"

    def set_gguf_parameters(self: Any) -> None:
        self.hparams.setdefault("n_ctx", self.hparams["n_positions"])
        known_params(self)

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    gpt2.GPT2Model.set_gguf_parameters = set_gguf_parameters
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
