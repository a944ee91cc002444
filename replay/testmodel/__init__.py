"""The test model: the factory (``factory``: build, ensure the default and twin models), the
task families it is trained on (``tasks``), the trainer (``python -m replay.testmodel.train``,
with the induction circuit it starts from in ``circuit``, its data in ``curriculum`` and its
evaluations in ``heldout``), and the committed weights in ``models/``. torch and transformers
come with the ``model`` extra."""
