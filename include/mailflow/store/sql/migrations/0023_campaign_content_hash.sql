-- 0023: a batch remembers which version of its campaign it was rendered from.
-- Campaign files (definition, audience SQL, templates) deploy with the DAGs and change without a
-- release, so the send log records, with each batch's bytes, a hash of the campaign content they
-- were rendered from (16 hex of sha256; mailflow.campaigns.folder.hash_content). The store writes it
-- in the statement that stores the bytes (send_log.save_batch, mint.save_batch_keyed); analysts
-- join send_log -> send_batch by idempotency_key to tell which version a user received
-- (docs/send_log.md). Batches stored before this migration keep NULL (unknown).
-- ADD COLUMN without a default: a catalog change, no table rewrite.
alter table mail.send_batch add column if not exists campaign_content_hash text;

comment on column mail.send_batch.campaign_content_hash is
    'Content hash of the campaign the bytes were rendered from: 16 hex of sha256 over its definition (lifecycle: '
    'its [[campaign]] table with [defaults]; scheduled: the mail.campaign fields that shape an email), its audience '
    'or recipients SQL and the templates it renders (layouts included). Equal hashes: same campaign content. '
    'Null: stored before 0023 or by a sender without campaign files.';

-- the read-only role (0004) reads the new column (send_batch is granted column by column)
do $$
begin
    if exists (select 1 from pg_roles where rolname = 'mail_analyst') then
        execute 'grant select (campaign_content_hash) on mail.send_batch to mail_analyst';
    end if;
exception
    when insufficient_privilege then
        raise warning 'mailflow 0023: cannot grant to mail_analyst: %', sqlerrm;
end
$$;
