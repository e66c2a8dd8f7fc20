"""Frontend-language programs that run unchanged on SGLang's frontend (``import sglang``) and on
sgl's (``import sgl``), against one server through ``RuntimeEndpoint``; prints their results as
JSON. tests/e2e/test_sglang_clients.py runs it with each and compares.

    python tests/e2e/lang_programs.py sglang|sgl http://127.0.0.1:30000
"""

from __future__ import annotations

import importlib
import json
import sys


def main(frontend: str, url: str) -> None:
    lang = importlib.import_module("sglang" if frontend == "sglang" else "sgl")
    lang.set_default_backend(lang.RuntimeEndpoint(url))

    @lang.function
    def facts(s, country):
        s += f"The capital of {country} is" + lang.gen("city", max_tokens=8, stop=".",
                                                       temperature=0)
        s += ". Is it a large city? Answer: " + lang.select("large", choices=["yes", "no"])
        s += "\nIts population in millions: " + lang.gen("number", max_tokens=4,
                                                         regex=r"[0-9]{1,3}", temperature=0)

    @lang.function
    def colors(s):
        s += "Here are two colours of the rainbow."
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"\nColour {i + 1}:" + lang.gen("colour", max_tokens=4, stop="\n",
                                                 temperature=0)
        s += "\nThe first was" + forks[0]["colour"] + " and the second" + forks[1]["colour"]

    @lang.function
    def with_logprobs(s):
        s += "Once upon a time" + lang.gen("story", max_tokens=6, temperature=0,
                                           return_logprob=True, top_logprobs_num=2,
                                           return_text_in_logprobs=True)

    one = facts.run(country="France")
    batch = facts.run_batch([{"country": "Italy"}, {"country": "Japan"}], num_threads=2)
    fork = colors.run()
    probs = with_logprobs.run()
    select_meta = one.get_meta_info("large")
    meta = probs.get_meta_info("story")
    print(json.dumps({
        "facts": {k: one[k] for k in ("city", "large", "number")},
        "facts_text": one.text(),
        "select_scores": [round(x, 3) for x in select_meta["normalized_prompt_logprobs"]],
        "batch": [{k: state[k] for k in ("city", "large", "number")} for state in batch],
        "fork_text": fork.text(),
        "story": probs["story"],
        "story_logprob_tokens": [entry[1] for entry in meta["output_token_logprobs"]],
        "story_logprobs_length": meta.get("output_token_logprobs_length"),
        "story_completion_tokens": meta["completion_tokens"],
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
