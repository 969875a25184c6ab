"""The Kafka side of a record's life: consume, check, submit, reply, commit; arms."""
