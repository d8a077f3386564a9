"""What can be decided and applied: the settings of one collective and the space they are searched in
(``comm_config``), what a target's NCCL, plugin and topology can apply (``capability``), the plan that holds a
decision per tuning key (``plan``), and its NCCL form (``emit``: environment, tuner rules, communicator configs).

These are the vocabulary the layers above share: the model prices settings, the search chooses them, the runtime
applies them. May import: ``lagom.step`` and the base modules.
"""
