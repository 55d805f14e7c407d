"""``tightfit bench``: tightfit's plan side by side with the tools people use today, on a GPU
with an emulated small-card budget (:mod:`.workloads`, :mod:`.settings`, :mod:`.peers`,
:mod:`.report`)."""
