"""select, fork/join and streaming."""

import os

import sgl

sgl.set_default_backend(sgl.RuntimeEndpoint(os.environ.get("SGL_URL", "http://127.0.0.1:30000")))


@sgl.function
def classify(s, review):
    s += "Review: " + review + "\nSentiment (positive or negative):"
    s += sgl.select("sentiment", [" positive", " negative"])


state = classify.run(review="A wonderful film, I loved every minute.")
print("sentiment:", state["sentiment"])
print("scores:", state.get_meta_info("sentiment")["normalized_prompt_logprobs"])


@sgl.function
def tips(s, topic):
    s += f"Here are two short tips about {topic}.\n"
    forks = s.fork(2)  # the text so far is cached once; both branches reuse it
    for i, f in enumerate(forks):
        f += f"Tip {i + 1}: Always"
        f += sgl.gen("tip", max_tokens=8, stop="\n", temperature=0)
    forks.join()  # the branches' "tip" becomes a list in s
    s += "Summary: Always" + s["tip"][0] + "; and always" + s["tip"][1]


state = tips.run(topic="sleep")
print(state.text())

state = classify.run(review="Dull and far too long.", stream=True)
for chunk in state.text_iter():
    print(chunk, end="", flush=True)
print()
