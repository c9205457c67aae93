"""The tokenizer service's logic: encoding, chat templates, the context check,
incremental detokenization and stop strings. Pure Python; the gRPC servicer
(and the gateway, for detokenization and stop strings) call into it."""
