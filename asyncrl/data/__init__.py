"""Prompt data: synthetic tasks, verl-layout loading, tokenised datasets and a resumable loader."""
