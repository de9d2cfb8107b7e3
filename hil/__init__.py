"""Hardware-in-the-loop: the mock spacecraft bus, its power-switch drivers, the testbench and the demo."""
