"""The data stage: dataset rows -> validated conversations -> tokenized rows with NeMo's loss masks."""
