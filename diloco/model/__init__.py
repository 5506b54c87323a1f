"""The models a run can train: a byte-level GPT and a Llama-family decoder, built from a
run's ``[model]`` section, and Hugging Face directories in and out.
"""
