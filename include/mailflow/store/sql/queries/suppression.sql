-- name: suppress_user
-- A person unsubscribed (one-click POST or the confirmation page): suppress the user for one list
-- (a campaign name) or 'all' marketing. ON CONFLICT DO NOTHING on suppression_user_scope_uq makes
-- a repeated POST harmless; RETURNING is empty when the suppression already existed.
insert into mail.suppression (user_id, scope, source, reason)
values (%(user_id)s, %(scope)s, %(source)s, %(reason)s)
on conflict do nothing
returning id

-- name: mailboxes_of_user
-- The mailboxes a user was ever mailed at (or planned for), by stored key, with one spelling of
-- each: "stop all marketing" under this user id suppresses them too (send_log_user_idx).
select email_key, min(email) from mail.send_log
where user_id = %(user_id)s and email_key is not null
group by email_key
order by email_key

-- name: suppress_mailboxes
-- Suppress these mailboxes for `scope`, as one statement: a bounce or complaint (the provider
-- reported it: the ADDRESS is suppressed, so a user who changes to a working address can be
-- reached again), "stop all" under a user id (the user's mailboxes), an operator. `keys` are mailbox
-- keys computed in Python (mailflow.store.policy.mailbox_key, via store.suppression), never here.
-- ON CONFLICT DO NOTHING on suppression_email_key_scope_uq (email_key, scope): a mailbox is
-- suppressed once per scope; RETURNING is empty for those already suppressed.
insert into mail.suppression (email, email_key, scope, source, reason)
select r.email, r.k, %(scope)s, %(source)s, %(reason)s
from unnest(%(emails)s::text[], %(keys)s::text[]) as r(email, k)
order by r.k
on conflict do nothing
returning id
