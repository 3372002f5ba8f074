"""vLLM's side of ``bench/engine.py --peer vllm``: runs inside vLLM's own venv
(``make bench-peers``), never imports pdserve, and answers timing requests on stdin.

Protocol: one JSON object a line on stdin, one JSON answer a line on the file descriptor that was
stdout when it started (vLLM's own logging goes to stderr):

    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": N}
        -> {"seconds": S, "tokens": T}   wall time of one ``LLM.generate`` (greedy, EOS ignored)
    {"op": "close"} -> {}                and the process exits

The first line written is ``{"ready": true, "version": "..."}`` once the engine has loaded.
Arguments: ``--model DIR --dtype float32|bfloat16 --max-num-seqs N --max-model-len L``.
``LLM(...)`` starts an engine process, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()

    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # whatever vLLM prints goes to stderr

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=0,
        disable_log_stats=True,
        # Every turn repeats the same prompts: with vLLM's default prefix caching, turns after
        # the first would reuse their KV and time a fraction of the prefill.
        enable_prefix_caching=False,
    )
    answers.write(json.dumps({"ready": True, "version": vllm.__version__}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "close":
            answers.write("{}\n")
            break
        params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        answers.write(json.dumps({"seconds": seconds, "tokens": tokens}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
