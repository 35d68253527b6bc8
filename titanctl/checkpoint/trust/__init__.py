"""What a checkpoint's files may be believed: paths stay inside it, pickles go through an allow-list,
checksums are verified, titanctl.json and the model args and shapes the files declare are checked, and
DCP folders are read one way (``reader``)."""
