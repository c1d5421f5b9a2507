"""peagle next to the ecosystem, one module per neighbour: `hub` (model cards, the upload folder, `push_to_hub`,
registered onto `PEagleDrafter`), `peft` (LoRA adapters on heads) and `vllm` (a vLLM environment run as a child
process: `process`, and the `runner` script it runs there).  Importing this package imports none of them."""
