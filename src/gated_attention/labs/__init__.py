"""Science labs: controlled experiments that show the paper's signature effects in minutes (`gattn lab ...`)."""
