-- name: suppress_user
-- A person unsubscribed (one-click POST or the confirmation page): suppress the user for one list
-- (a campaign name) or 'all' marketing. ON CONFLICT DO NOTHING on suppression_user_scope_uq makes
-- a repeated POST harmless; RETURNING is empty when the suppression already existed.
insert into mail.suppression (user_id, scope, source, reason)
values (%(user_id)s, %(scope)s, %(source)s, %(reason)s)
on conflict do nothing
returning id

-- name: suppress_address
-- The provider reported a hard bounce or a complaint: suppress the ADDRESS for all mail (a user who
-- changes to a working address can be reached again). ON CONFLICT DO NOTHING on
-- suppression_email_scope_uq (lower(email), scope): an address is suppressed once.
insert into mail.suppression (email, scope, source, reason)
values (%(email)s, 'all', %(source)s, %(reason)s)
on conflict do nothing
returning id
