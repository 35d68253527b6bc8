"""Model families: a registry (``registry``: model.name -> the family's spec, the only door into a family),
what a family declares (``spec``), every weight's shape (``shapes``), the blocks they share (``common/``), and
one folder per family."""
