"""Experiments beside the product: ``lagom reproduce`` (the published GPT/BERT/T5 and A40 runs on the
simulator) and its ``--real`` runs through both adapters on gloo ranks. Lagom's core never imports
this package; it imports the core and both adapters."""
