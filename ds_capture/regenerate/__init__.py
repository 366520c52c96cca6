"""The regenerate stage: a dataset's assistant turns rewritten by the target through an OpenAI-compatible server.

In:  a chat dataset ``ds-capture run`` reads, a server URL (vLLM, SGLang, ``transformers serve``) and model name,
     the generation settings. Out: a JSONL dataset in ``messages`` form, one row per input row in input order,
     that ``ds-capture run`` reads as is (``ds-capture regenerate``; docs/regenerate.md).

``turns`` says which turns of a row are rewritten and what each request holds, ``client`` sends one chat
completion (retries, refusals), ``journal`` keeps the progress beside the output and assembles it, ``driver``
runs the rows concurrently. The stage sits after ``data`` (it validates rows with ``run``'s rules) and needs
no model: the server holds the target.
"""
