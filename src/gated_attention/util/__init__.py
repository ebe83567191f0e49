"""The base layer: what every other layer may use and which imports nothing of the model. deprecation.py keeps
moved import paths working for one release."""
