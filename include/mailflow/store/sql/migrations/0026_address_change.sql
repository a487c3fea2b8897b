-- 0026: a scheduled email goes to the recipient's address at send time, not at provisioning.
-- When the dispatcher claims due scheduled rows it reads each user's current address from the
-- campaign's recipient source (its recipients SQL file, or its table unless that is the uploaded
-- list mail.campaign_recipient) before the contact policy and the address checks run. A changed
-- address replaces the row's email and email_key; the old and new ones are kept here, one row per
-- change, written in the claim's transaction (docs/model.md, "The address at send time").
-- A new table: brief locks only.
create table if not exists mail.address_change (
    id            bigint      generated always as identity primary key,
    send_log_id   bigint      not null references mail.send_log (id),
    user_id       bigint      not null,
    campaign      text        not null,
    old_email     text        not null,
    old_email_key text,
    new_email     text        not null,
    new_email_key text,
    changed_at    timestamptz not null default now(),
    dag_id        text,
    run_id        text,
    task_id       text
);
create index if not exists address_change_send_log_idx on mail.address_change (send_log_id);
create index if not exists address_change_user_idx on mail.address_change (user_id, changed_at);

comment on table mail.address_change is
    'A scheduled email re-addressed at claim time: the recipient''s address in the campaign''s recipient source '
    'differed from the one snapshotted at provisioning. One row per change, written in the claim''s transaction; '
    'the send-log row then carries the new address. A row that was already attempted (it has an idempotency key '
    'and stored bytes) is never re-addressed.';
comment on column mail.address_change.id is 'Change id (identity).';
comment on column mail.address_change.send_log_id is 'The re-addressed email (mail.send_log.id).';
comment on column mail.address_change.user_id is 'Recipient''s app user id.';
comment on column mail.address_change.campaign is 'Campaign name (mail.send_log.campaign).';
comment on column mail.address_change.old_email is 'The address the row held before (the provisioning snapshot or an earlier change).';
comment on column mail.address_change.old_email_key is 'Mailbox key of the old address (see mail.send_log.email_key); null if it was invalid.';
comment on column mail.address_change.new_email is 'The address the recipient source returned at claim time (trimmed, as stored in the source).';
comment on column mail.address_change.new_email_key is 'Mailbox key of the new address; null if it is invalid (the row then fails address hygiene).';
comment on column mail.address_change.changed_at is 'When the claim re-addressed the row (timestamptz, UTC; database clock).';
comment on column mail.address_change.dag_id is 'Airflow DAG of the dispatch run that re-addressed the row.';
comment on column mail.address_change.run_id is 'Airflow run id of that dispatch run.';
comment on column mail.address_change.task_id is 'Airflow task id of that dispatch run.';
