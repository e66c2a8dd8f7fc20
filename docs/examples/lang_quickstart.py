"""Few-shot QA, a multi-turn chat and typed generation with sgl's frontend language."""

import os

import sgl

sgl.set_default_backend(sgl.RuntimeEndpoint(os.environ.get("SGL_URL", "http://127.0.0.1:30000")))


@sgl.function
def few_shot_qa(s, question):
    s += "Answer with one word.\n"
    s += "Q: What is the capital of Germany?\nA: Berlin\n"
    s += "Q: What is the capital of Italy?\nA: Rome\n"
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=8, stop="\n", temperature=0)


state = few_shot_qa.run(question="What is the capital of France?")
print("answer:", state["answer"])


@sgl.function
def chat(s, first, second):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(first)
    s += sgl.assistant(sgl.gen("reply1", max_tokens=24))
    with s.user():
        s += second
    with s.assistant():
        s += sgl.gen("reply2", max_tokens=24)


state = chat.run(first="Name a fruit.", second="What color is it?", temperature=0)
for message in state.messages():
    print(f"{message['role']}: {message['content']}")


@sgl.function
def arithmetic(s):
    s += "Q: What is 2 + 3?\nA: The answer is "
    s += sgl.gen("number", dtype=int, max_tokens=4, temperature=0)


number = arithmetic.run()["number"]
print("number:", number, type(number).__name__)
