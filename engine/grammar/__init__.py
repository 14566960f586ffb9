"""Structured output: constraints compiled into grammars, and the vocabulary masks they give."""
