"""Bundled tasks: prompts with reference answers, and the rule checker used to measure."""
