"""Speculation control: the controller the engine talks to (`controller.py`) and the governors it holds
(length policies, the draft gate and its admission rule, the measured switch, online upkeep), the step-cost
table, confidence calibration and acceptance bookkeeping."""
