"""run_batch with a shared few-shot prefix, and the compiled form of a program."""

import os

import sgl

sgl.set_default_backend(sgl.RuntimeEndpoint(os.environ.get("SGL_URL", "http://127.0.0.1:30000")))

SHOTS = "".join(f"Q: What is {i} + {i}?\nA: {2 * i}\n" for i in range(1, 9))


@sgl.function
def add(s, a, b):
    s += "Additions.\n" + SHOTS
    s += f"Q: What is {a} + {b}?\nA:"
    s += sgl.gen("sum", max_tokens=3, stop="\n", temperature=0)


print("traced prefix:", repr(add.prefix()[-30:]))
states = add.run_batch([{"a": i, "b": i} for i in range(1, 17)], progress_bar=True)
for state in states[:4]:
    print(state.text().splitlines()[-1], "| cached tokens:",
          state.get_meta_info("sum")["cached_tokens"])

compiled = add.compile()
print(compiled.run(a=20, b=20)["sum"])
