"""Quality of the fast paths against the float32 reference, on the same weights.

    python benchmarks/quality.py [--model PATH] [--paths 0,9]

For each path (float32, bfloat16, bfloat16 + int8 or int4 weight-only, + w8a8, + w4a8, and with
the int8 KV cache: float32, bfloat16, w4a8; float32 + w4a8, auto's pick on CPUs without native
bfloat16, with its float32 and (auto's) int8 KV cache; --paths: indices into PATHS, the
reference first) over a fixed English text (this file's TEXT, ~230 tokens): perplexity from
prompt logprobs, the largest and mean |Δ logprob| of the text's tokens against float32, and
whether greedy answers to fixed chat prompts match float32's. Prints one JSON line per path.
"""

from __future__ import annotations

import argparse
import json
import math

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined a screw press with movable metal type, oil-based ink and a mould "
    "for casting letters quickly. Before that, books in Europe were copied by hand, and a "
    "single Bible could take a scribe more than a year. Printing spread fast: by 1500 there "
    "were presses in more than two hundred cities, and millions of books had been printed. "
    "Cheaper books changed how people learned. Scholars could compare the same text in "
    "different cities, errors could be corrected in a new edition, and ideas travelled "
    "further than any messenger. Governments and churches soon tried to control what was "
    "printed, with licences and lists of forbidden books, but pamphlets still moved across "
    "borders. In the following centuries newspapers appeared, first as weekly sheets of "
    "commercial news and later as daily papers read by millions. The steam-powered press of "
    "the nineteenth century made printing faster again, and paper made from wood pulp made "
    "it cheaper. Today most text is read on screens, yet the habits the press created, such "
    "as standard spelling, page numbers and the idea of an author, are still with us."
)
CHATS = ["What is the capital of France?", "Name three primary colors.",
         "Write one sentence about the moon.", "What is 12 times 12?"]
# (dtype, quantization, kv_cache_dtype); the first is the reference.
PATHS = [("float32", None, "auto"), ("bfloat16", None, "auto"), ("bfloat16", "int8", "auto"),
         ("bfloat16", "int4", "auto"), ("bfloat16", "w8a8", "auto"), ("bfloat16", "w4a8", "auto"),
         ("float32", None, "int8"), ("bfloat16", None, "int8"), ("bfloat16", "w4a8", "int8"),
         ("float32", "w4a8", "auto"), ("float32", "w4a8", "int8")]


def main() -> None:
    from met import LLM, SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--paths", default=None, help="comma-separated indices into PATHS")
    args = ap.parse_args()
    chosen = PATHS if args.paths is None else [PATHS[int(i)] for i in args.paths.split(",")]
    reference: dict = {}
    for dtype, quant, kv_dtype in chosen:
        llm = LLM(args.model, dtype=dtype, quantization=quant, max_model_len=2048,
                  kv_cache_dtype=kv_dtype)
        ids = llm.tokenizer(TEXT)["input_ids"]
        out = llm.generate({"prompt_token_ids": ids},
                           SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        lps = [entry[t] for t, entry in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]
        answers = [o.outputs[0].text for o in llm.chat(
            [[{"role": "user", "content": c}] for c in CHATS],
            SamplingParams(max_tokens=32, temperature=0.0))]
        row = {"dtype": dtype, "quantization": quant, "kv_cache_dtype": kv_dtype,
               "tokens": len(ids),
               "perplexity": round(math.exp(-sum(lps) / len(lps)), 4)}
        if not reference:
            reference = {"lps": lps, "answers": answers}
        else:
            diffs = [abs(a - b) for a, b in zip(lps, reference["lps"], strict=True)]
            row |= {"max_abs_dlogprob": round(max(diffs), 4),
                    "mean_abs_dlogprob": round(sum(diffs) / len(diffs), 4),
                    "greedy_answers_equal_float32": sum(
                        a == b for a, b in zip(answers, reference["answers"], strict=True)),
                    "answers": answers}
        print(json.dumps(row), flush=True)
        del llm


if __name__ == "__main__":
    main()
