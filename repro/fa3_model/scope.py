"""What the CPU model covers, with no import of its own: the GPU it predicts for and the SM configurations whose SM
count it knows. The expectations read it without importing the model (numpy), and the model without importing the
expectations, so neither imports the other back."""

from __future__ import annotations

H200_SMS = 132  # the model predicts for an H200
MODEL_SM_KINDS = ("full", "sm_margin", "mps")  # where the CPU model knows the SM count FA3 plans for
