"""What the tests and the benchmarks share, outside the shipped package: the fault server (an
OpenAI-compatible server that misbehaves on purpose), the document generators, the CLI runner and
free ports. Neither the tests nor the benchmarks import the other."""
